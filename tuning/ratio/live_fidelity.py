"""The shadow checks' results as the scheduler keeps them (`/server_info`, the target's ratios).

The checks run in SGLang's HTTP process (`sglang_ext/server/shadow_checks.py`) and send each
result to the scheduler over the control channel (`hicache_ext.fidelity.record`), which hands it
here. The scheduler keeps the rolling window that
`/server_info` reports (`internal_states[i].hicache_ext.fusion.shadow`), feeds the agreement
target that sets "auto"'s ratio per chunk tier (`tuning/ratio/agreement_target.py`), exports the
tiers' ratios as a gauge, and logs one line when the window's agreement falls below the target
(and one when it is back).
"""

from __future__ import annotations

import logging
import statistics
import threading
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from sglang_hicache_ext.tuning.ratio.agreement_target import MIN_SAMPLES, AgreementTarget

logger = logging.getLogger(__name__)

# Told each tier's ratio whenever the target reads or moves it (the server's gauge).
RatioObserver = Callable[[str, float], None]


class LiveFidelity:
    """Per scheduler process: the latest checks and, with a target, the ratio of each tier."""

    def __init__(
        self,
        target: AgreementTarget | None,
        window: int,
        on_ratio: RatioObserver | None = None,
    ) -> None:
        """`target`: the token-agreement target that moves each tier's ratio (None: the window
        only); `window`: how many of the latest checks the window averages."""
        self.target = target
        self._on_ratio = on_ratio
        self._window: deque[dict[str, Any]] = deque(maxlen=window)
        self._checks_sent: dict[str, int] = {}  # the HTTP process's counts, as last sent
        self._below = False
        self._lock = threading.Lock()

    def ratio(self, tier: str, floor: float, start: float | None = None) -> float:
        """The target's ratio for `tier` (see AgreementTarget.ratio)."""
        assert self.target is not None
        ratio = self.target.ratio(tier, floor, start)
        if self._on_ratio is not None:
            self._on_ratio(tier, ratio)
        return ratio

    def record(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """One check's result (the control message's body); the tier's new ratio if it moved."""
        try:
            agreement = float(body["token_agreement"])
            check = {
                "token_agreement": agreement,
                "first_token_agree": bool(body["first_token_agree"]),
                "recompute_ratio": float(body["recompute_ratio"]),
            }
            counts = {str(k): int(v) for k, v in dict(body.get("counts") or {}).items()}
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"malformed shadow check result: {err!r}") from None
        moved = None
        tier = body.get("ratio_tier")
        if self.target is not None and isinstance(tier, str) and "tier_ratio" in body:
            moved = self.target.record(tier, float(body["tier_ratio"]), agreement)
            if moved is not None:
                logger.info(
                    "fusion ratio of tier %s -> %.3f (token agreement target %.2f)",
                    tier,
                    moved,
                    self.target.target,
                )
                if self._on_ratio is not None:
                    self._on_ratio(tier, moved)
        with self._lock:
            self._window.append(check)
            self._checks_sent = counts
            self._log_crossing()
        return {"moved_to": moved}

    def _log_crossing(self) -> None:
        if self.target is None or len(self._window) < MIN_SAMPLES:
            return
        mean = statistics.fmean(c["token_agreement"] for c in self._window)
        below = mean < self.target.target
        if below and not self._below:
            logger.warning(
                "fusion shadow checks: token agreement %.3f over the last %d checks is below "
                "the target %.2f",
                mean,
                len(self._window),
                self.target.target,
            )
        elif self._below and not below:
            logger.info("fusion shadow checks: token agreement %.3f meets the target again", mean)
        self._below = below

    def status(self) -> dict[str, Any]:
        with self._lock:
            window = list(self._window)
            counts = dict(self._checks_sent)
        status: dict[str, Any] = {
            "samples": len(window),
            "token_agreement": _mean(c["token_agreement"] for c in window),
            "first_token_agreement": _mean(float(c["first_token_agree"]) for c in window),
            "ratio": _mean(c["recompute_ratio"] for c in window),
            "checks": counts,
        }
        if self.target is not None:
            status["target"] = self.target.status()
            status["below_target"] = self._below
        return status


def _mean(values: Any) -> float | None:
    values = list(values)
    return statistics.fmean(values) if values else None
