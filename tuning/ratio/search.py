"""Golden-section search for the recompute ratio, warm-started at the roofline prior.

CacheTune's Algorithm 1: one of the two first probes is the prior r0 instead of a golden point,
then each step keeps the better probe and evaluates one new golden point, until the bracket is
narrower than the tolerance. Two departures from the algorithm as printed, both for the bounds:
a prior on a bound is moved half a tolerance inside (Algorithm 1 would keep a probe on the bound
and stop shrinking the bracket); and the answer is the best point evaluated, with the bound
itself evaluated once when the final bracket touches it, not the bracket's midpoint. On a fast
tier TTFT rises from r_min on, and the midpoint of the last bracket sits a tolerance above it:
8 % more TTFT measured on the CPU server at tolerance 0.02. Written out rather than
`scipy.optimize.minimize_scalar(method="golden")`, because scipy places its probes only from a
bracket triple whose middle point must already beat both ends — no warm start, and a minimum at
r_min (the usual case on fast tiers) is not a valid bracket.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

PHI = (math.sqrt(5.0) - 1.0) / 2.0  # 0.618...


class Probe(NamedTuple):
    ratio: float
    value: float  # the objective, e.g. mean TTFT in seconds over the calibration prompts


class SearchResult(NamedTuple):
    ratio: float  # r*: the best point evaluated (see `golden_section`)
    prior: float  # r0 the search started from
    bounds: tuple[float, float]  # [r_min, r_max]
    probes: tuple[Probe, ...]  # every evaluation, in order

    @property
    def best_probe(self) -> Probe:
        return min(self.probes, key=lambda p: p.value)


def golden_section(
    objective: Callable[[float], float],
    prior: float,
    r_min: float,
    r_max: float,
    tolerance: float = 0.02,
) -> SearchResult:
    """Minimise `objective` over [r_min, r_max] (Algorithm 1); one evaluation per step."""
    if not 0.0 <= r_min <= r_max <= 1.0:
        raise ValueError(f"need 0 <= r_min <= r_max <= 1, got {r_min}, {r_max}")
    if tolerance <= 0:
        raise ValueError(f"tolerance must be > 0, got {tolerance}")
    prior = min(max(prior, r_min), r_max)
    probes: list[Probe] = []

    def evaluate(ratio: float) -> float:
        value = float(objective(ratio))
        if not math.isfinite(value):
            raise ValueError(f"objective at ratio {ratio:.4f} is not finite: {value}")
        probes.append(Probe(ratio, value))
        return value

    a, b = r_min, r_max
    if b - a < tolerance:
        return SearchResult((a + b) / 2, prior, (r_min, r_max), ())
    # A prior on a bound (a fast tier clipped to r_min) is moved just inside, so that every
    # probe the bracket keeps is interior and each step shrinks it.
    start = min(max(prior, a + tolerance / 2), b - tolerance / 2)
    kept = Probe(start, evaluate(start))
    while True:
        # Lines 5-9 and 15/19 of Algorithm 1: the new probe is the golden point on the far
        # side of the one kept.
        ratio = a + PHI * (b - a) if kept.ratio <= (a + b) / 2 else b - PHI * (b - a)
        new = Probe(ratio, evaluate(ratio))
        low, high = sorted((kept, new))
        if low.value < high.value:
            b, kept = high.ratio, low
        else:
            a, kept = low.ratio, high
        if b - a < tolerance:
            break
    for bound in {a, b} & {r_min, r_max}:  # the optimum may sit on a bound
        if all(abs(p.ratio - bound) > 1e-12 for p in probes):
            evaluate(bound)
    best = min(probes, key=lambda p: p.value)
    return SearchResult(best.ratio, prior, (r_min, r_max), tuple(probes))
