"""Trace replay through a DRAM LRU tier and a TTL-governed disk tier.

Model: every block access goes to DRAM first (LRU by bytes, optional), then to disk. Disk is
write-through from DRAM: every accessed block is written to, or refreshed on, disk with the expiry
given by `sglang_hicache_ext.tiers.ttl_policy.TtlPolicy`, whatever tier served it. Hits are counted per block.
Disk bytes are integrated exactly: after each access a block occupies the disk until
min(expiry, its next access, end of trace).

Online mode re-plans at every period boundary from the requests of earlier periods only (at most
`history_s` back); the first period has no history and uses `initial_ttl_s`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from sglang_hicache_ext.radix.access_recorder import AccessRecorder
from sglang_hicache_ext.radix.groups import SubtreeGrouping
from sglang_hicache_ext.tiers.ttl_policy import TtlPolicy, TtlTable
from sglang_hicache_ext.tuning.lru import BlockLru
from sglang_hicache_ext.tuning.trace import TraceRequest
from sglang_hicache_ext.tuning.ttl.budget import average_pages
from sglang_hicache_ext.tuning.ttl.planner import PlannedTtls, TtlPlanner

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
    initial_ttl_s: float = 60.0

    def __post_init__(self) -> None:
        if self.bytes_per_block <= 0:
            raise ValueError(f"bytes_per_block must be > 0, got {self.bytes_per_block}")
        for name in ("disk_budget_bytes", "dram_bytes", "initial_ttl_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if self.period_s <= 0 or self.history_s <= 0:
            raise ValueError("period_s and history_s must be > 0")

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
            "avg_disk_bytes": self.avg_disk_bytes,
            "peak_disk_bytes": self.peak_disk_bytes,
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
    recorder = AccessRecorder()
    if config.online:
        boundaries = list(np.arange(start, end, config.period_s)) + [end]
        initial = PlannedTtls(TtlTable(config.initial_ttl_s), SubtreeGrouping(), "initial")
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
    disk: dict[str, tuple[float, float]] = {}  # page -> (last access, expiry)
    seg_start: list[float] = []
    seg_end: list[float] = []
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
        for page, group in zip(request.pages, grouping.groups_of_path(request.pages), strict=True):
            accesses += 1
            previous = disk.get(page)
            if dram.access(page):
                dram_hits += 1
            elif previous is not None and policy.is_live(previous[1], now):
                disk_hits += 1
            if previous is not None:
                seg_start.append(previous[0])
                seg_end.append(min(previous[1], now))
            disk[page] = (now, policy.expiry_on_access(group, now))
        if config.online:
            recorder.record_request(now, request.pages)
        if progress is not None and done % _PROGRESS_EVERY == 0:
            progress(_PROGRESS_EVERY)
    if progress is not None:
        progress(len(requests) % _PROGRESS_EVERY)
    for last_access, expiry in disk.values():
        seg_start.append(last_access)
        seg_end.append(min(expiry, end))

    avg_pages, peak_pages = _occupancy(np.asarray(seg_start), np.asarray(seg_end), end - start)
    periods = tuple(
        PeriodTtls(begin, plans[i + 1][0] if i + 1 < len(plans) else end, planned, window)
        for i, (begin, planned, window) in enumerate(plans)
    )
    return ReplayResult(
        policy=planner.name,
        accesses=accesses,
        dram_hits=dram_hits,
        disk_hits=disk_hits,
        avg_disk_bytes=avg_pages * config.bytes_per_block,
        peak_disk_bytes=peak_pages * config.bytes_per_block,
        duration_s=end - start,
        periods=periods,
    )


def _occupancy(starts: np.ndarray, ends: np.ndarray, duration: float) -> tuple[float, float]:
    """Average and peak number of pages resident, from half-open residency segments."""
    if starts.size == 0:
        return 0.0, 0.0
    ends = np.maximum(ends, starts)
    average = float((ends - starts).sum() / duration) if duration > 0 else 0.0
    times = np.concatenate((starts, ends))
    steps = np.concatenate((np.ones(starts.size), -np.ones(ends.size)))
    # At equal times apply departures first: a refresh ends one segment where the next begins.
    order = np.lexsort((steps, times))
    return average, float(np.cumsum(steps[order]).max())
