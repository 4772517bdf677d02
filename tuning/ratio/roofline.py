"""The roofline model of a fused prefill: TTFT against the recompute ratio (CacheTune §4.3).

With layer l+1's KV loading while layer l computes, each layer costs the slower of recomputing
r·N tokens and loading the (1-r)·N others, plus a fixed overhead (Eq. 9); the prefill is that
times the layer count (Eq. 10). The two paths balance at r0 = t_i / (t_c + t_i) (Eq. 11), the
prior the golden-section search starts from.
"""

from __future__ import annotations

import math
from typing import NamedTuple


class TierCosts(NamedTuple):
    """Measured or projected costs of one (model, tier): seconds per token per layer."""

    recompute_s: float  # t_c: recomputing one token through one layer
    load_s: float  # t_i: bringing one token's K and V of one layer from the tier
    overhead_s: float = 0.0  # t_o: per-layer fixed cost, independent of the ratio

    def check(self) -> TierCosts:
        for name, value in self._asdict().items():
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
        if self.recompute_s + self.load_s <= 0:
            raise ValueError("recompute_s and load_s cannot both be 0")
        return self


def layer_time(costs: TierCosts, ratio: float, tokens: int, overlapped: bool = True) -> float:
    """Eq. 9: one layer's time; without overlap the two paths add up instead."""
    recompute = ratio * tokens * costs.recompute_s
    load = (1.0 - ratio) * tokens * costs.load_s
    return (max(recompute, load) if overlapped else recompute + load) + costs.overhead_s


def predicted_ttft(
    costs: TierCosts, ratio: float, tokens: int, layers: int, overlapped: bool = True
) -> float:
    """Eq. 10: the fused prefill of `tokens` chunk tokens (start-up bubbles neglected)."""
    return layers * layer_time(costs, ratio, tokens, overlapped)


def roofline_prior(costs: TierCosts, r_min: float = 0.0, r_max: float = 1.0) -> float:
    """Eq. 11, clipped to the search bounds [r_min, r_max]."""
    if not 0.0 <= r_min <= r_max <= 1.0:
        raise ValueError(f"need 0 <= r_min <= r_max <= 1, got {r_min}, {r_max}")
    costs.check()
    r0 = costs.load_s / (costs.recompute_s + costs.load_s)
    return min(max(r0, r_min), r_max)
