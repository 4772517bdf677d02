"""Discrete-event replay of a request trace on N instances sharing one disk tier."""

from __future__ import annotations

import heapq
import math
import zlib
from collections.abc import Callable, Sequence

import numpy as np

from sglang_hicache_ext.tiers.pages.ttl_policy import TtlPolicy, TtlTable
from sglang_hicache_ext.tuning.cost import GB, Pricing, deployment_cost, disk_type
from sglang_hicache_ext.tuning.lru import BlockLru
from sglang_hicache_ext.tuning.sim.channel import IoChannel
from sglang_hicache_ext.tuning.sim.config import SimConfig
from sglang_hicache_ext.tuning.sim.disk import DiskTier
from sglang_hicache_ext.tuning.sim.instance import Instance, Stats
from sglang_hicache_ext.tuning.sim.occupancy import ttl_peak_blocks
from sglang_hicache_ext.tuning.sim.profile import Profile
from sglang_hicache_ext.tuning.sim.result import SimResult, TierHits
from sglang_hicache_ext.tuning.trace import SimRequest

_HEADROOM = 1.1  # provisioned disk over the TTL policy's peak footprint
_MIN_DISK_GB = 20.0


def simulate(
    requests: Sequence[SimRequest],
    config: SimConfig,
    profile: Profile | None = None,
    pricing: Pricing | None = None,
) -> SimResult:
    """Replay `requests` (sorted by arrival) under `config`; see `SimResult` for the outputs."""
    if not requests:
        raise ValueError("cannot simulate an empty trace")
    profile = profile or Profile()
    pricing = pricing or Pricing()
    disk, disk_gb = _build_disk(requests, config, profile)
    stats = Stats(
        [math.nan] * len(requests), [math.nan] * len(requests), [math.nan] * len(requests)
    )
    dram_blocks = int(config.dram_gb * GB // profile.block_bytes)
    cache_blocks = (
        profile.prefix_cache_tokens // profile.block_tokens if config.gpu_prefix_cache else 0
    )
    instances = [
        Instance(profile, BlockLru(cache_blocks), BlockLru(dram_blocks), disk, stats, config.disk)
        for _ in range(config.instances)
    ]
    targets = _route(requests, config)
    # Next arrival per instance, so a decoding instance knows when to stop for a prefill.
    arrivals_of: list[list[float]] = [[] for _ in instances]
    for request, target in zip(requests, targets, strict=True):
        arrivals_of[target].append(request.arrival_s)
    seen = [0] * len(instances)

    def next_arrival(i: int) -> float:
        times = arrivals_of[i]
        return times[seen[i]] if seen[i] < len(times) else math.inf

    events: list[tuple[float, int, int]] = []  # (time, tie-break, instance): iteration ends
    tie = 0
    for rid, (request, target) in enumerate(zip(requests, targets, strict=True)):
        while events and events[0][0] < request.arrival_s:
            tie = _advance(events, instances, next_arrival, tie)
        instance = instances[target]
        seen[target] += 1
        instance.enqueue(rid, request, request.arrival_s)
        if not instance.busy:
            tie = _start(instance, target, request.arrival_s, next_arrival(target), events, tie)
    while events:
        tie = _advance(events, instances, next_arrival, tie)
    return _summarise(requests, config, stats, disk, disk_gb, pricing)


def _advance(
    events: list[tuple[float, int, int]],
    instances: list[Instance],
    next_arrival: Callable[[int], float],
    tie: int,
) -> int:
    now, _, index = heapq.heappop(events)
    instance = instances[index]
    instance.busy = False
    instance.complete_iteration(now)
    return _start(instance, index, now, next_arrival(index), events, tie)


def _start(
    instance: Instance,
    index: int,
    now: float,
    next_arrival: float,
    events: list[tuple[float, int, int]],
    tie: int,
) -> int:
    end = instance.next_iteration(now, next_arrival)
    if end is not None:
        instance.busy = True
        heapq.heappush(events, (end, tie, index))
        tie += 1
    return tie


def _route(requests: Sequence[SimRequest], config: SimConfig) -> list[int]:
    n = config.instances
    if config.routing == "round_robin":
        return [i % n for i in range(len(requests))]
    # crc32, not hash(): the routing must not change with PYTHONHASHSEED across workers.
    return [zlib.crc32(r.blocks[min(1, len(r.blocks) - 1)].encode()) % n for r in requests]


def _build_disk(
    requests: Sequence[SimRequest], config: SimConfig, profile: Profile
) -> tuple[DiskTier | None, float]:
    spec = config.disk
    if spec is None or (spec.policy == "ttl" and spec.ttl_s == 0):
        return None, 0.0
    kind = disk_type(spec.disk_type)
    if spec.capacity_gb is not None:
        capacity_gb = spec.capacity_gb
    else:
        peak = _peak_blocks(requests, spec.ttl_s)
        capacity_gb = max(_MIN_DISK_GB, math.ceil(peak * profile.block_bytes * _HEADROOM / GB))
    capacity_gb = max(capacity_gb, kind.level_for(capacity_gb).min_gb)  # billed anyway: use it
    policy = TtlPolicy(TtlTable(spec.ttl_s)) if spec.policy == "ttl" else None
    tier = DiskTier(
        capacity_blocks=int(capacity_gb * GB // profile.block_bytes),
        channel=IoChannel(profile.disk_bytes_s or kind.bandwidth_bytes_s(capacity_gb)),
        block_bytes=profile.block_bytes,
        policy=policy,
        max_write_backlog_s=spec.max_write_backlog_s,
    )
    return tier, float(capacity_gb)


# Search workers simulate one trace under many configurations but only a few TTLs: keep each
# footprint. The key holds the trace itself so that its id cannot be reused by another list.
_PEAKS: dict[tuple[int, float], tuple[Sequence[SimRequest], int]] = {}


def _peak_blocks(requests: Sequence[SimRequest], ttl_s: float) -> int:
    key = (id(requests), ttl_s)
    cached = _PEAKS.get(key)
    if cached is None or cached[0] is not requests:
        if len(_PEAKS) >= 64:
            _PEAKS.clear()
        cached = (requests, ttl_peak_blocks(requests, ttl_s))
        _PEAKS[key] = cached
    return cached[1]


def _summarise(
    requests: Sequence[SimRequest],
    config: SimConfig,
    stats: Stats,
    disk: DiskTier | None,
    disk_gb: float,
    pricing: Pricing,
) -> SimResult:
    ttft = np.asarray(stats.ttft)
    start = requests[0].arrival_s
    makespan = max(float(np.max(stats.finish)) - start, 1e-9)
    tokens = sum(r.input_tokens + r.output_tokens for r in requests)
    blocks = max(stats.blocks, 1)
    kind = disk_type(config.disk.disk_type) if disk is not None and config.disk else None
    cost = deployment_cost(
        pricing,
        instances=config.instances,
        dram_gb_per_instance=config.dram_gb,
        disk=kind,
        disk_gb=disk_gb,
        hours=makespan / 3600.0,
    )
    return SimResult(
        requests=len(requests),
        mean_ttft_s=float(ttft.mean()),
        p90_ttft_s=float(np.percentile(ttft, 90)),
        p99_ttft_s=float(np.percentile(ttft, 99)),
        mean_queue_s=float(np.mean(stats.queue)),
        throughput_tok_s=tokens / makespan,
        makespan_s=makespan,
        hit_ratio=TierHits(
            stats.gpu_hits / blocks, stats.dram_hits / blocks, stats.disk_hits / blocks
        ),
        disk_gb=disk_gb,
        disk_bandwidth_mb_s=disk.channel.bytes_per_s / 1e6 if disk is not None else 0.0,
        disk_writes_dropped=disk.writes_dropped if disk is not None else 0,
        cost=cost,
    )
