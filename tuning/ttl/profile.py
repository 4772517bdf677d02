"""Per-group hit and cost curves of a TTL, and the smooth surrogate the optimiser climbs.

With the TTL refreshed on every access, a page re-accessed after an interval delta is a hit iff
delta <= t, and it occupies the disk for min(t, delta) of that interval plus t after its last
access. Hence, for a group with reuse intervals Delta_g and unique pages B_g:

    H_g(t) = #{delta in Delta_g : delta <= t}                    (hits)
    C_g(t) = |B_g| * t + sum_{delta in Delta_g} min(t, delta)    (page-seconds on disk)

H_g is a step function, useless to a gradient method (zero gradient almost everywhere). The
surrogate is a kernel-smoothed CDF in log-time:

    H~_g(t) = #{delta = 0} + sum_{delta > 0} Phi((ln t - ln delta) / h_g)

i.e. every interval is spread over a log-normal kernel, h_g from Silverman's rule on ln delta.
It is sound in the sense that matters: smooth and strictly increasing (so SLSQP gets a useful
gradient), same limits as H_g (the zero-delta hits at t -> 0, |Delta_g| at t -> inf), and H~_g -> H_g
at every continuity point as h -> 0. Smoothing in log-time makes the blur relative (a TTL of 10 s
vs 12 s matters as much as 1000 s vs 1200 s), which suits heavy-tailed reuse intervals. The
surrogate is only the search direction: C_g is used exactly (it is continuous, piecewise linear)
and every candidate is scored with the exact H_g.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import ndtr

# Silverman's bandwidth is clamped: too narrow re-creates the steps, too wide erases the shape.
MIN_BANDWIDTH = 0.05
MAX_BANDWIDTH = 1.0
_TINY_TTL = 1e-6


@dataclass(frozen=True)
class GroupProfile:
    """Reuse intervals (sorted) and unique page count of one group, with H, C and surrogate."""

    name: str
    intervals: np.ndarray
    unique_pages: int
    prefix_sums: np.ndarray  # prefix_sums[k] = sum of the k smallest intervals
    log_values: np.ndarray  # distinct positive intervals, in log-time
    log_counts: np.ndarray
    zero_intervals: int
    bandwidth: float

    @classmethod
    def build(cls, name: str, intervals: np.ndarray, unique_pages: int) -> GroupProfile:
        deltas = np.sort(np.asarray(intervals, dtype=np.float64))
        if deltas.size and (deltas[0] < 0 or not np.all(np.isfinite(deltas))):
            raise ValueError(f"group {name!r}: reuse intervals must be finite and >= 0")
        if unique_pages < 0:
            raise ValueError(f"group {name!r}: unique_pages must be >= 0")
        positive = deltas[deltas > 0]
        values, counts = np.unique(positive, return_counts=True)
        logs = np.log(positive)
        spread = float(np.std(logs)) if logs.size > 1 else 1.0
        silverman = 1.06 * spread * max(logs.size, 1) ** -0.2
        return cls(
            name=name,
            intervals=deltas,
            unique_pages=int(unique_pages),
            prefix_sums=np.concatenate(([0.0], np.cumsum(deltas))),
            log_values=np.log(values),
            log_counts=counts.astype(np.float64),
            zero_intervals=int(deltas.size - positive.size),
            bandwidth=float(np.clip(silverman, MIN_BANDWIDTH, MAX_BANDWIDTH)),
        )

    @property
    def reuse_events(self) -> int:
        return int(self.intervals.size)

    def hits(self, ttl: float) -> int:
        """Exact H(t)."""
        return int(np.searchsorted(self.intervals, ttl, side="right"))

    def cost(self, ttl: float) -> float:
        """Exact C(t) in page-seconds."""
        covered = int(np.searchsorted(self.intervals, ttl, side="right"))
        uncovered = self.intervals.size - covered
        return float(self.unique_pages * ttl + self.prefix_sums[covered] + ttl * uncovered)

    def cost_slope(self, ttl: float) -> float:
        """Right derivative of C at t: every page's tail plus the still-open intervals."""
        covered = int(np.searchsorted(self.intervals, ttl, side="right"))
        return float(self.unique_pages + self.intervals.size - covered)

    def smooth_hits(self, ttl: float) -> float:
        return self.zero_intervals + float(self.log_counts @ ndtr(self._z(ttl)))

    def smooth_hits_slope(self, ttl: float) -> float:
        z = self._z(ttl)
        density = np.exp(-0.5 * z * z) / np.sqrt(2.0 * np.pi)
        return float(self.log_counts @ density) / (self.bandwidth * max(ttl, _TINY_TTL))

    def ttl_for_cost(self, budget: float, max_ttl: float = np.inf) -> float:
        """Largest t <= max_ttl with C(t) <= budget (exact: C is piecewise linear, increasing)."""
        if budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        knots = self.intervals
        knot_costs = (
            self.unique_pages * knots
            + self.prefix_sums[1:]
            + knots * (knots.size - np.arange(1, knots.size + 1))
        )
        # Segment k spans [knots[k-1], knots[k]]; there C(t) = a_k * t + prefix_sums[k].
        k = int(np.searchsorted(knot_costs, budget, side="right"))
        slope = self.unique_pages + knots.size - k
        if slope == 0:
            return float(max_ttl)  # nothing left to pay for: any TTL is free
        return float(min((budget - self.prefix_sums[k]) / slope, max_ttl))

    def roi_optimal_ttl(self) -> float:
        """argmax_t H(t)/C(t): only the jump points of H can be maxima."""
        candidates = np.unique(self.intervals[self.intervals > 0])
        if candidates.size == 0:
            return 0.0
        covered = np.searchsorted(self.intervals, candidates, side="right")
        costs = (
            self.unique_pages * candidates
            + self.prefix_sums[covered]
            + candidates * (self.intervals.size - covered)
        )
        return float(candidates[int(np.argmax(covered / costs))])

    def _z(self, ttl: float) -> np.ndarray:
        return (np.log(max(ttl, _TINY_TTL)) - self.log_values) / self.bandwidth


def merge_profiles(profiles: list[GroupProfile], name: str = "all") -> GroupProfile:
    """One profile holding every group's intervals and pages (what a single TTL sees)."""
    intervals = np.concatenate([p.intervals for p in profiles]) if profiles else np.empty(0)
    return GroupProfile.build(name, intervals, sum(p.unique_pages for p in profiles))
