"""Adaptive Pareto exploration (Kareto, Algorithm 1) over DRAM x TTL, per disk type.

A coarse grid first; then, each round, (1) DRAM expansion: while the last DRAM step still cuts
the no-disk (TTL 0) mean TTFT by more than `tau_expand`, add the next DRAM column for every TTL;
(2) refinement: between lattice neighbours whose latency or throughput differ by more than
`tau_perf` *and* whose cost differs by more than `tau_cost` (all relative), add the midpoint.
Midpoints snap to the `dram_step` x `ttl_step` lattice and stop there, so the search always ends
and its points are a subset of the matching fine grid.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

from sglang_hicache_ext.tuning.pareto.evaluator import Evaluation, PointEvaluator
from sglang_hicache_ext.tuning.pareto.space import NO_DISK, Point, Space


@dataclass(frozen=True)
class AdaptiveSettings:
    coarse: Space
    dram_limit_gb: float  # expansion never goes beyond this DRAM per instance
    dram_step_gb: float  # finest refinement step
    ttl_step_s: float
    tau_expand: float = 0.05
    tau_perf: float = 0.05
    tau_cost: float = 0.02

    def __post_init__(self) -> None:
        if self.dram_step_gb <= 0 or self.ttl_step_s <= 0:
            raise ValueError("refinement steps must be > 0")
        if min(self.tau_expand, self.tau_perf, self.tau_cost) < 0:
            raise ValueError("thresholds must be >= 0")


def adaptive_search(settings: AdaptiveSettings, evaluator: PointEvaluator) -> list[Evaluation]:
    coarse = settings.coarse
    done: dict[Point, Evaluation] = {}
    candidates = set(coarse.grid())
    while candidates:
        for evaluation in evaluator.evaluate(sorted(candidates - done.keys())):
            done[evaluation.point] = evaluation
        candidates = _expansion(settings, done) | _refinement(settings, done)
        candidates -= done.keys()
    return sorted(done.values(), key=lambda e: e.point)


def _expansion(settings: AdaptiveSettings, done: dict[Point, Evaluation]) -> set[Point]:
    step = settings.coarse.dram.step
    d_max = max(p.dram_gb for p in done if p.ttl_s == 0)
    previous = done.get(Point(d_max - step, 0.0, NO_DISK))
    if previous is None or d_max + step > settings.dram_limit_gb + 1e-9:
        return set()
    gain = _relative(
        previous.result.mean_ttft_s, done[Point(d_max, 0.0, NO_DISK)].result.mean_ttft_s
    )
    if gain <= settings.tau_expand:
        return set()
    return {
        Point.make(d_max + step, t, k)
        for t in settings.coarse.ttl.values()
        for k in settings.coarse.disks
    }


def _refinement(settings: AdaptiveSettings, done: dict[Point, Evaluation]) -> set[Point]:
    found: set[Point] = set()
    for a, b in _neighbours(done, settings.coarse.disks):
        ra, rb = done[a].result, done[b].result
        perf = max(
            _relative(ra.mean_ttft_s, rb.mean_ttft_s),
            _relative(ra.throughput_tok_s, rb.throughput_tok_s),
        )
        if (
            perf > settings.tau_perf
            and _relative(ra.cost.total_usd, rb.cost.total_usd) > settings.tau_cost
        ):
            middle = _midpoint(a, b, settings)
            if middle is not None:
                found.add(middle)
    return found


def _neighbours(
    done: dict[Point, Evaluation], disks: tuple[str, ...]
) -> Iterator[tuple[Point, Point]]:
    """Adjacent simulated pairs along DRAM (same TTL) and along TTL (same DRAM), per disk type.

    TTL-0 points have no disk, so they neighbour the lowest TTL of every disk type.
    """
    for disk in disks:
        lattice = [p for p in done if p.disk in (disk, NO_DISK)]
        by_ttl: defaultdict[float, list[Point]] = defaultdict(list)
        by_dram: defaultdict[float, list[Point]] = defaultdict(list)
        for p in lattice:
            by_ttl[p.ttl_s].append(p)
            by_dram[p.dram_gb].append(p)
        for line in (*by_ttl.values(), *by_dram.values()):
            line.sort()
            yield from zip(line[:-1], line[1:], strict=True)


def _midpoint(a: Point, b: Point, settings: AdaptiveSettings) -> Point | None:
    disk = b.disk if a.disk == NO_DISK else a.disk
    dram = _snap_between(a.dram_gb, b.dram_gb, settings.dram_step_gb)
    ttl = _snap_between(a.ttl_s, b.ttl_s, settings.ttl_step_s)
    if dram is None or ttl is None:
        return None
    return Point.make(dram, ttl, disk)


def _snap_between(x: float, y: float, step: float) -> float | None:
    """The lattice value nearest the midpoint strictly between x and y; x itself if x == y."""
    low, high = min(x, y), max(x, y)
    if high - low < 1e-9:
        return low
    middle = low + step * math.floor((high - low) / step / 2 + 1e-9)
    return middle if low < middle < high else None


def _relative(a: float, b: float) -> float:
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale > 0 else 0.0
