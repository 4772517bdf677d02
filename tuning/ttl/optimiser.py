"""ROI-aware group TTL allocation (Kareto, Algorithm 2) and the fixed-TTL baseline.

    max_t  sum_g H_g(t_g)   s.t.  sum_g C_g(t_g) <= B,  0 <= t_g <= max_ttl

SLSQP climbs the smooth surrogate of H_g (see `sglang_hicache_ext.tuning.ttl.profile`) with the exact, piecewise
linear C_g as constraint, from floor(sqrt(K)) + 1 starts: the per-group ROI-optimal TTLs scaled
to the budget, then random log-normal perturbations of it. Two deterministic extra starts are
added: the fixed-TTL solution (so the group answer is never worse than one TTL on the data it was
fitted on) and the greedy optimum of the concave relaxation. Every start and every SLSQP end point
is made feasible (TTLs scaled down by one factor until the budget holds), left-over budget is
spent by scaling TTLs up (hits never drop when a TTL grows), and the exact sum of H_g picks the
winner.

SLSQP's small dense solves slow down 10-100x when a multi-threaded OpenBLAS runs on busy cores;
the CLI and the benchmark set OPENBLAS_NUM_THREADS=1.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq, minimize

from sglang_hicache_ext.tuning.ttl.profile import GroupProfile, merge_profiles
from sglang_hicache_ext.tuning.ttl.profile_set import ProfileSet

PERTURBATION_SIGMA = 0.5  # log-normal spread of the random starts around the scaled ROI point
_SLSQP_OPTIONS = {"maxiter": 200, "ftol": 1e-9}
_NEGLIGIBLE_TTL_S = 1e-6


@dataclass(frozen=True)
class TtlSolution:
    ttls: dict[str, float]  # group name -> TTL seconds
    hits: int  # exact sum_g H_g(t_g)
    cost: float  # exact sum_g C_g(t_g), page-seconds
    budget: float
    starts: int


def solve_fixed_ttl(
    profiles: Sequence[GroupProfile], budget: float, max_ttl: float = math.inf
) -> TtlSolution:
    """One TTL for every group: the largest t whose total cost fits the budget (exact)."""
    _check_budget(budget)
    ttl = merge_profiles(list(profiles)).ttl_for_cost(budget, max_ttl)
    return _solution(ProfileSet(profiles), np.full(len(profiles), ttl), budget, starts=1)


def solve_group_ttls(
    profiles: Sequence[GroupProfile],
    budget: float,
    max_ttl: float,
    top_k: int | None = None,
    seed: int = 0,
    hull_start: bool = True,
) -> TtlSolution:
    """Per-group TTLs maximising exact hits within `budget` page-seconds (Algorithm 2)."""
    _check_budget(budget)
    if not profiles:
        return TtlSolution({}, 0, 0.0, budget, 0)
    if not math.isfinite(max_ttl) or max_ttl <= 0:
        raise ValueError(f"max_ttl must be finite and > 0, got {max_ttl}")
    k = len(profiles) - 1 if top_k is None else top_k
    groups = ProfileSet(profiles)
    rng = np.random.default_rng(seed)
    roi = np.array([min(p.roi_optimal_ttl(), max_ttl) for p in profiles])
    unscaled = float(groups.cost(roi).sum())
    scaled = roi * (budget / unscaled) if unscaled > 0 else roi
    starts = [np.clip(scaled, 0.0, max_ttl)]
    for _ in range(math.isqrt(max(k, 0))):
        noise = rng.lognormal(0.0, PERTURBATION_SIGMA, size=len(profiles))
        starts.append(np.clip(scaled * noise, 0.0, max_ttl))
    fixed = solve_fixed_ttl(profiles, budget, max_ttl)
    starts.append(np.array([fixed.ttls[p.name] for p in profiles]))
    if hull_start:
        starts.append(_concave_hull_start(profiles, budget, max_ttl))

    best: tuple[int, np.ndarray] | None = None
    for start in starts:
        for point in (start, _slsqp(groups, start, budget, max_ttl)):
            candidate = fit_budget(groups, point, budget, max_ttl)
            hits = int(groups.hits(candidate).sum())
            if best is None or hits > best[0]:
                best = (hits, candidate)
    assert best is not None
    return _solution(groups, best[1], budget, starts=len(starts))


def _concave_hull_start(
    profiles: Sequence[GroupProfile], budget: float, max_ttl: float
) -> np.ndarray:
    """Greedy on the concave hulls of the exact (C_g, H_g) curves, steepest segments first.

    This is the optimum of the concave relaxation of the separable problem; it gives SLSQP a
    start where the surrogate's gradient is informative even when a group's intervals are so
    concentrated that its smoothed CDF is flat almost everywhere.
    """
    segments: list[tuple[float, float, int, float]] = []  # (slope, extra cost, group, ttl)
    for index, profile in enumerate(profiles):
        inside = profile.intervals[(profile.intervals > 0) & (profile.intervals <= max_ttl)]
        ttls = np.unique(np.concatenate(([0.0], inside)))
        hits = np.searchsorted(profile.intervals, ttls, side="right")
        costs = (
            profile.unique_pages * ttls
            + profile.prefix_sums[hits]
            + ttls * (profile.intervals.size - hits)
        )
        hull = _upper_hull(costs, hits.astype(np.float64))
        for a, b in itertools.pairwise(hull):
            extra = costs[b] - costs[a]
            if extra > 0 and hits[b] > hits[a]:
                segments.append(((hits[b] - hits[a]) / extra, extra, index, float(ttls[b])))
    chosen = np.zeros(len(profiles))
    spent = 0.0
    for _, extra, index, ttl in sorted(segments, key=lambda s: -s[0]):
        if spent + extra > budget:
            break  # hull slopes fall within a group, so its later segments cannot come first
        chosen[index] = ttl
        spent += extra
    return chosen


def _upper_hull(x: np.ndarray, y: np.ndarray) -> list[int]:
    """Indices of the upper concave hull of points sorted by x (monotone chain)."""
    hull: list[int] = []
    for i in range(x.size):
        while len(hull) >= 2:
            o, a = hull[-2], hull[-1]
            if (x[a] - x[o]) * (y[i] - y[o]) - (y[a] - y[o]) * (x[i] - x[o]) >= 0:
                hull.pop()
            else:
                break
        hull.append(i)
    return hull


def _slsqp(groups: ProfileSet, start: np.ndarray, budget: float, max_ttl: float) -> np.ndarray:
    # Work in x = t / max_ttl and normalise objective and constraint to O(1): SLSQP is not
    # scale-invariant and page-second budgets are ~1e7.
    events = max(groups.reuse_events, 1)
    scale = max(budget, 1e-12)

    def objective(x: np.ndarray) -> float:
        return -float(groups.smooth_hits(x * max_ttl).sum()) / events

    def objective_grad(x: np.ndarray) -> np.ndarray:
        return -groups.smooth_hits_slope(x * max_ttl) * max_ttl / events

    def slack(x: np.ndarray) -> float:
        return 1.0 - float(groups.cost(x * max_ttl).sum()) / scale

    def slack_grad(x: np.ndarray) -> np.ndarray:
        return -groups.cost_slope(x * max_ttl) * max_ttl / scale

    result = minimize(
        objective,
        start / max_ttl,
        jac=objective_grad,
        method="SLSQP",
        bounds=[(0.0, 1.0)] * len(groups),
        constraints=[{"type": "ineq", "fun": slack, "jac": slack_grad}],
        options=_SLSQP_OPTIONS,
    )
    return np.clip(np.asarray(result.x, dtype=np.float64), 0.0, 1.0) * max_ttl


def fit_budget(groups: ProfileSet, ttls: np.ndarray, budget: float, max_ttl: float) -> np.ndarray:
    """Scale TTLs by one factor so that the total cost meets the budget (down or up)."""

    def excess(scale: float) -> float:
        return float(groups.cost(np.minimum(ttls * scale, max_ttl)).sum()) - budget

    # A TTL under a microsecond keeps nothing; SLSQP leaves some at 1e-314, whose scale ceiling
    # (max_ttl / t) overflows to inf.
    ttls = np.where(ttls < _NEGLIGIBLE_TTL_S, 0.0, ttls)
    if not np.any(ttls > 0):
        return ttls
    if excess(1.0) > 0:
        scale = brentq(excess, 0.0, 1.0, xtol=1e-12, maxiter=500)
    else:
        ceiling = max_ttl / float(ttls[ttls > 0].min())
        if excess(ceiling) <= 0:
            return np.minimum(ttls * ceiling, max_ttl)
        scale = brentq(excess, 1.0, ceiling, xtol=1e-9, maxiter=500)
    # brentq's root may sit a hair above the budget; step below it so the budget holds exactly.
    while scale > 0 and excess(scale) > 0:
        scale *= 1 - 1e-9
    return np.minimum(ttls * scale, max_ttl)


def _solution(groups: ProfileSet, ttls: np.ndarray, budget: float, starts: int) -> TtlSolution:
    return TtlSolution(
        ttls={name: float(t) for name, t in zip(groups.names, ttls, strict=True)},
        hits=int(groups.hits(ttls).sum()),
        cost=float(groups.cost(ttls).sum()),
        budget=budget,
        starts=starts,
    )


def _check_budget(budget: float) -> None:
    if not math.isfinite(budget) or budget < 0:
        raise ValueError(f"budget must be finite and >= 0 page-seconds, got {budget}")
