"""The ratio of `fusion_recompute_ratio: "auto"` on a server without a tuned ratio table.

The server profiles its own chunk tiers from the fused prefills it runs anyway, so the profile
costs no extra request and its time is bounded by construction: t_c (seconds to compute one
token through one layer) from each fused prefill's time over the token-layers it computed, and
per lower tier t_i (seconds to load one token's K and V of one layer) from the rows it read.
A tier's ratio is the roofline prior r0 = t_i / (t_c + t_i) (`roofline.py`, Eq. 11) clipped to
[floor, 1]: from host memory loading is nearly free and the floor rules; from a tier slower
than the compute, the ratio rises to where loading the reused rows stops costing more than
recomputing them. It never goes below the model's quality floor (`quality_floors.json`), and a
model without a measured floor gets a conservative one. Until a tier has been measured it gets
the floor. Estimates are running means over the last `window` observations.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Mapping

from sglang_hicache_ext.tuning.ratio.quality_floor import quality_floor
from sglang_hicache_ext.tuning.ratio.roofline import TierCosts, roofline_prior
from sglang_hicache_ext.tuning.ratio.table import token_weighted_ratio

logger = logging.getLogger(__name__)

# A model whose quality floor was never measured: the ratio the fusion-quality measurements
# needed on the models measured so far (docs/fusion-quality.md), rather than the papers' 0.15.
CONSERVATIVE_FLOOR = 0.3
# The same model when the server checks its fused answers live against a token-agreement target
# (`agreement_target.py`): it still starts at the conservative ratio, but the checks stand in for
# the missing measurement and may lower it to where the papers start (CacheTune's r_min).
CHECKED_FLOOR = 0.15
HOST_TIER = "host"
_LOG_EVERY_S = 60.0


class SelfTunedRatios:
    """Per-tier ratios from the server's own measurements (thread-safe: the scheduler records,
    a status route may read)."""

    def __init__(
        self, floor: float, floor_source: str, window: int = 32, start: float | None = None
    ) -> None:
        if not 0.0 <= floor <= 1.0:
            raise ValueError(f"the ratio floor must be in [0, 1], got {floor}")
        self.floor = floor
        self.floor_source = floor_source
        # Where a token-agreement target starts a tier (never below its ratio here): above the
        # floor only for a model whose floor is the checked one, not a measured one.
        self.start = floor if start is None else max(floor, start)
        self._compute: deque[float] = deque(maxlen=window)
        self._load: dict[str, deque[float]] = {}
        self._window = window
        self._lock = threading.Lock()
        self._logged_at = -math.inf

    @classmethod
    def for_model(cls, model_name: str, checked: bool = False) -> SelfTunedRatios:
        """With the model's measured floor, else the conservative one; `checked`: the server
        holds a token-agreement target and runs shadow checks, which may lower a model with no
        measured floor from the conservative ratio to the papers' 0.15."""
        measured = quality_floor(model_name)
        if measured is not None and measured.ratio is not None:
            return cls(measured.ratio, f"quality floor of {model_name} ({measured.source})")
        if checked:
            return cls(
                CHECKED_FLOOR,
                f"no measured floor for {model_name}; a token-agreement target checks it live "
                f"from {CONSERVATIVE_FLOOR} down",
                start=CONSERVATIVE_FLOOR,
            )
        return cls(CONSERVATIVE_FLOOR, f"conservative floor (no measured floor for {model_name})")

    def record_compute(self, seconds: float, token_layers: int) -> None:
        """A fused prefill took `seconds` for `token_layers` computed (tokens x layers)."""
        if token_layers > 0 and seconds > 0 and math.isfinite(seconds):
            with self._lock:
                self._compute.append(seconds / token_layers)
            self._log()

    def compute_s_per_token_layer(self) -> float | None:
        """The mean of the recent fused prefills' compute per computed token-layer; None
        before the first."""
        with self._lock:
            return _mean(self._compute) if self._compute else None

    def record_load(self, tier: str, seconds: float, token_layers: int) -> None:
        """Reading `token_layers` rows (tokens x layers) of a tier took `seconds`."""
        if tier != HOST_TIER and token_layers > 0 and seconds >= 0 and math.isfinite(seconds):
            with self._lock:
                samples = self._load.setdefault(tier, deque(maxlen=self._window))
                samples.append(seconds / token_layers)
            self._log()

    def tier_ratio(self, tier: str) -> float:
        with self._lock:
            loads = self._load.get(tier)
            if tier == HOST_TIER or not loads or not self._compute:
                return self.floor
            costs = TierCosts(_mean(self._compute), _mean(loads))
        return roofline_prior(costs.check(), self.floor, 1.0)

    def ratio_for(self, tokens_by_tier: Mapping[str, int]) -> float:
        """Token-weighted ratio of one request's chunks (a request mixing tiers spends the sum
        of what each chunk's tier asks for), never below the floor."""
        total = sum(tokens_by_tier.values())
        if total <= 0:
            return self.floor
        ratios = {tier: self.tier_ratio(tier) for tier in tokens_by_tier}
        return min(1.0, max(self.floor, token_weighted_ratio(ratios, tokens_by_tier)))

    def status(self) -> dict[str, object]:
        with self._lock:
            compute = _mean(self._compute) if self._compute else None
            loads = {tier: _mean(samples) for tier, samples in self._load.items()}
        return {
            "floor": self.floor,
            "floor_source": self.floor_source,
            "target_start": self.start,
            "compute_s_per_token_layer": compute,
            "load_s_per_token_layer": loads,
            "ratios": {tier: self.tier_ratio(tier) for tier in (HOST_TIER, *loads)},
        }

    def _log(self) -> None:
        now = time.monotonic()
        if now - self._logged_at >= _LOG_EVERY_S:
            self._logged_at = now
            logger.info('fusion ratio "auto" (self-tuned): %s', self.status())


def _mean(samples: deque[float]) -> float:
    return sum(samples) / len(samples)
