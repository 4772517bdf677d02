"""Trace replay through a DRAM LRU tier and a TTL-governed disk tier.

Model: every block access goes to DRAM first (LRU by bytes, optional), then to disk. Disk is
write-through from DRAM: every accessed block is written to, or refreshed on, disk with the expiry
given by `TtlPolicy` (`tiers/pages/ttl_policy.py`), whatever tier served it. Hits are counted per
block. Like the live page store (`tiers/pages/page_store.py`), the disk can have a hard capacity
(the live default is twice the budget, `DiskTierSettings`): a write that does not fit evicts the
soonest-expiring blocks.
Disk bytes are integrated exactly: after each access a block occupies the disk until
min(expiry, its eviction, its next access, end of trace).

Online mode re-plans at every period boundary from the requests of earlier periods only (at most
`history_s` back). The first period has no history: its TTL is paced from the budget and the
write rate seen so far (`paced_ttl`), or is `initial_ttl_s` when that is given.

`score_from_s` (seconds after the first request) splits a trace into a warm-up, replayed to give
the planner its history but not scored, and the part scored (hits and disk bytes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from sglang_hicache_ext.radix.access_recorder import AccessRecorder
from sglang_hicache_ext.radix.groups import SubtreeGrouping
from sglang_hicache_ext.tiers.pages.ttl_policy import TtlPolicy, TtlTable
from sglang_hicache_ext.tuning.lru import BlockLru
from sglang_hicache_ext.tuning.trace import TraceRequest
from sglang_hicache_ext.tuning.ttl.budget import average_pages, paced_ttl
from sglang_hicache_ext.tuning.ttl.planner import PlannedTtls, TtlPlanner
from sglang_hicache_ext.tuning.ttl.simulated_disk import SimulatedDisk

# KV bytes of one token for a Llama-3-8B-like model in fp16:
# 32 layers x 2 (K and V) x 8 KV heads x 128 head dim x 2 bytes = 128 KiB; a 512-token block is
# then 64 MiB.
DEFAULT_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2
_PROGRESS_EVERY = 1024  # requests between two progress reports


@dataclass(frozen=True)
class ReplayConfig:
    bytes_per_block: int
    disk_budget_bytes: float  # average bytes on disk over the replay
    dram_bytes: float = 0.0
    online: bool = False
    period_s: float = 300.0
    history_s: float = math.inf
    initial_ttl_s: float | None = None  # None: paced from the budget and the write rate
    max_ttl_s: float = 3600.0  # cap of the paced first-period TTL
    score_from_s: float = 0.0  # seconds after the first request; earlier accesses are warm-up
    disk_capacity_bytes: float | None = None  # hard capacity; None: uncapped

    def __post_init__(self) -> None:
        if self.bytes_per_block <= 0:
            raise ValueError(f"bytes_per_block must be > 0, got {self.bytes_per_block}")
        for name in ("disk_budget_bytes", "dram_bytes", "score_from_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if self.initial_ttl_s is not None and not (
            math.isfinite(self.initial_ttl_s) and self.initial_ttl_s >= 0
        ):
            raise ValueError(f"initial_ttl_s must be finite and >= 0, got {self.initial_ttl_s}")
        if self.period_s <= 0 or self.history_s <= 0 or self.max_ttl_s <= 0:
            raise ValueError("period_s, history_s and max_ttl_s must be > 0")
        if self.disk_capacity_bytes is not None and not self.disk_capacity_bytes >= 0:
            raise ValueError(f"disk_capacity_bytes must be >= 0, got {self.disk_capacity_bytes}")

    @property
    def capacity_pages(self) -> float:
        """The hard capacity in pages (inf: uncapped)."""
        capacity = self.disk_capacity_bytes
        if capacity is None or not math.isfinite(capacity):
            return math.inf
        return math.floor(capacity / self.bytes_per_block)

    @property
    def budget_pages(self) -> float:
        """The budget as an average number of pages resident on disk."""
        return average_pages(self.disk_budget_bytes, self.bytes_per_block)


class PeriodTtls(NamedTuple):
    start_s: float
    end_s: float
    planned: PlannedTtls
    planned_from_s: tuple[float, float] | None  # history window used; None: initial TTL


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    accesses: int
    dram_hits: int
    disk_hits: int
    avg_disk_bytes: float
    peak_disk_bytes: float
    duration_s: float
    periods: tuple[PeriodTtls, ...] = field(default_factory=tuple)
    seconds_over_budget: float = 0.0  # time the disk held more than the budget
    budget_bytes: float = 0.0
    capacity_evictions: int = 0  # blocks evicted because the disk was full

    @property
    def misses(self) -> int:
        return self.accesses - self.dram_hits - self.disk_hits

    def ratio(self, count: int) -> float:
        return count / self.accesses if self.accesses else 0.0

    @property
    def disk_hit_ratio(self) -> float:
        return self.ratio(self.disk_hits)

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "accesses": self.accesses,
            "hit_ratio": {
                "dram": self.ratio(self.dram_hits),
                "disk": self.ratio(self.disk_hits),
                "total": self.ratio(self.dram_hits + self.disk_hits),
                "miss": self.ratio(self.misses),
            },
            "budget_bytes": self.budget_bytes,
            "avg_disk_bytes": self.avg_disk_bytes,
            "peak_disk_bytes": self.peak_disk_bytes,
            "peak_over_budget": self.peak_disk_bytes / self.budget_bytes
            if self.budget_bytes
            else None,
            "seconds_over_budget": self.seconds_over_budget,
            "capacity_evictions": self.capacity_evictions,
            "duration_s": self.duration_s,
            "ttls": [
                {
                    "start_s": p.start_s,
                    "end_s": p.end_s,
                    "planned_from_s": p.planned_from_s,
                    "choice": p.planned.choice,
                    "ttl_s": p.planned.table.as_dict(),
                }
                for p in self.periods
            ],
        }


def replay(
    requests: Sequence[TraceRequest],
    planner: TtlPlanner,
    config: ReplayConfig,
    progress: Callable[[int], object] | None = None,
) -> ReplayResult:
    """Replay `requests` (time-sorted) with TTLs from `planner` under `config`.

    `progress`, if given, is called with the number of requests replayed since its last call
    (every 1024 requests and at the end), e.g. a tqdm bar's `update`.
    """
    if not requests:
        return ReplayResult(planner.name, 0, 0, 0, 0.0, 0.0, 0.0)
    start, end = requests[0].time_s, requests[-1].time_s
    scored_from = start + config.score_from_s
    if scored_from >= end:
        raise ValueError("score_from_s leaves nothing of the trace to score")
    recorder = AccessRecorder()
    paced = config.online and config.initial_ttl_s is None
    page_writes = 0
    if config.online:
        boundaries = list(np.arange(start, end, config.period_s)) + [end]
        first_ttl = 0.0 if config.initial_ttl_s is None else config.initial_ttl_s
        initial = PlannedTtls(
            TtlTable(first_ttl), SubtreeGrouping(), "paced" if paced else "initial"
        )
        plans = [(start, initial, None)]
    else:
        for request in requests:
            recorder.record_request(request.time_s, request.pages)
        whole = (start, float(np.nextafter(end, np.inf)))
        boundaries = [start, end]
        plans = [(start, planner.plan(recorder, *whole, config.budget_pages), whole)]

    policy = TtlPolicy(plans[0][1].table)
    grouping = plans[0][1].grouping
    dram = BlockLru.of_bytes(config.dram_bytes, config.bytes_per_block)
    disk = SimulatedDisk(config.capacity_pages, keep_segments=True)
    dram_hits = disk_hits = accesses = 0
    period = 1
    for done, request in enumerate(requests, start=1):
        now = request.time_s
        while config.online and period < len(boundaries) - 1 and now >= boundaries[period]:
            boundary = float(boundaries[period])
            history_start = max(start, boundary - config.history_s)
            planned = planner.plan(recorder, history_start, boundary, config.budget_pages)
            policy.update(planned.table)
            grouping = planned.grouping
            plans.append((boundary, planned, (history_start, boundary)))
            recorder.forget_before(boundary - config.history_s)
            period += 1
            paced = False
        if paced:
            ttl = paced_ttl(config.budget_pages, page_writes, now - start, config.max_ttl_s)
            policy.update(TtlTable(ttl))
        scored = now >= scored_from
        for page, group in zip(request.pages, grouping.groups_of_path(request.pages), strict=True):
            in_dram = dram.access(page)
            on_disk = disk.access(page, policy.expiry_on_access(group, now), now)
            if scored:
                accesses += 1
                if in_dram:
                    dram_hits += 1
                elif on_disk:
                    disk_hits += 1
        page_writes += len(request.pages)
        if config.online:
            recorder.record_request(now, request.pages)
        if progress is not None and done % _PROGRESS_EVERY == 0:
            progress(_PROGRESS_EVERY)
    if progress is not None:
        progress(len(requests) % _PROGRESS_EVERY)
    occupancy = _occupancy(*disk.segments(end), scored_from, end, config.budget_pages)
    periods = tuple(
        PeriodTtls(begin, plans[i + 1][0] if i + 1 < len(plans) else end, planned, window)
        for i, (begin, planned, window) in enumerate(plans)
    )
    return ReplayResult(
        policy=planner.name,
        accesses=accesses,
        dram_hits=dram_hits,
        disk_hits=disk_hits,
        avg_disk_bytes=occupancy.average * config.bytes_per_block,
        peak_disk_bytes=occupancy.peak * config.bytes_per_block,
        duration_s=end - scored_from,
        periods=periods,
        seconds_over_budget=occupancy.seconds_over,
        budget_bytes=config.disk_budget_bytes,
        capacity_evictions=disk.evictions,
    )


class Occupancy(NamedTuple):
    average: float  # pages resident, time-averaged over the scored span
    peak: float
    seconds_over: float  # time with more than the budget's pages resident


def _occupancy(
    starts: np.ndarray, ends: np.ndarray, begin: float, end: float, budget_pages: float
) -> Occupancy:
    """Occupancy of half-open residency segments, clipped to the scored span [begin, end]."""
    starts, ends = np.clip(starts, begin, end), np.clip(ends, begin, end)
    ends = np.maximum(ends, starts)
    if starts.size == 0 or end <= begin:
        return Occupancy(0.0, 0.0, 0.0)
    average = float((ends - starts).sum() / (end - begin))
    times = np.concatenate((starts, ends))
    steps = np.concatenate((np.ones(starts.size), -np.ones(ends.size)))
    # At equal times apply departures first: a refresh ends one segment where the next begins.
    order = np.lexsort((steps, times))
    times, level = times[order], np.cumsum(steps[order])
    over = float(np.diff(times)[level[:-1] > budget_pages + 1e-9].sum())
    return Occupancy(average, float(level.max()), over)
