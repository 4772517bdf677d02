"""Simulator sanity: tiers, queueing, the prefetch-in-queue rule, costs and bad input."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest

from sglang_hicache_ext.tiers.pages.ttl_policy import TtlPolicy, TtlTable
from sglang_hicache_ext.tuning.cost import GB, disk_type
from sglang_hicache_ext.tuning.lru import BlockLru
from sglang_hicache_ext.tuning.sim import (
    DiskConfig,
    Profile,
    SimConfig,
    SimRequest,
    TraceError,
    load_requests,
    simulate,
)
from sglang_hicache_ext.tuning.sim.calibrate import DecodeSample, PrefillSample, fit_profile
from sglang_hicache_ext.tuning.sim.channel import IoChannel
from sglang_hicache_ext.tuning.sim.disk import DiskTier
from sglang_hicache_ext.tuning.sim.occupancy import ttl_peak_blocks

# The production trace, in the shared folder beside the checkout (the package never looks there).
CONVERSATION = (
    Path(__file__).resolve().parents[2] / "shared/data/traces/mooncake_conversation_trace.jsonl"
)
needs_trace = pytest.mark.skipif(
    not CONVERSATION.is_file(), reason=f"shared trace not found at {CONVERSATION}"
)

# A small model keeps synthetic runs fast: 16 KiB/token KV, 64-token blocks (1 MiB).
SMALL = Profile(kv_bytes_per_token=16384, block_tokens=64, prefix_cache_tokens=64 * 8)


def conversations(
    n_conv: int = 40, turns: int = 4, gap_s: float = 20.0, spacing_s: float = 2.0, seed: int = 0
) -> list[SimRequest]:
    """Multi-turn chats: each turn repeats the previous prompt's blocks and adds two."""
    rng = random.Random(seed)
    requests = []
    for c in range(n_conv):
        blocks = ["sys", f"c{c}-0"]
        start = c * spacing_s
        for t in range(turns):
            blocks = [*blocks, f"c{c}-{t}a", f"c{c}-{t}b"]
            arrival = start + t * gap_s + rng.uniform(0, 1)
            requests.append(SimRequest(arrival, len(blocks) * 64 - 10, 16, tuple(blocks)))
    return sorted(requests, key=lambda r: r.arrival_s)


def scaled(requests: list[SimRequest], factor: float) -> list[SimRequest]:
    return [r._replace(arrival_s=r.arrival_s * factor) for r in requests]


def test_no_cache_means_no_hits_and_caches_do_hit() -> None:
    requests = conversations()
    bare = simulate(requests, SimConfig(gpu_prefix_cache=False), SMALL)
    assert bare.hit_ratio.total == 0.0
    cached = simulate(requests, SimConfig(dram_gb=1.0), SMALL)
    assert cached.hit_ratio.total > 0.4
    assert cached.mean_ttft_s < bare.mean_ttft_s


def test_queueing_delay_grows_with_load() -> None:
    requests = conversations(n_conv=60)
    slow = Profile(prefill_per_token_s=2e-4, kv_bytes_per_token=16384, block_tokens=64)
    queues = [
        simulate(scaled(requests, f), SimConfig(gpu_prefix_cache=False), slow).mean_queue_s
        for f in (4.0, 1.0, 0.25, 0.05)
    ]
    assert queues == sorted(queues)
    assert queues[-1] > 10 * max(queues[0], 1e-3)


def test_more_dram_never_lowers_lru_hit_ratio_in_a_block_lru() -> None:
    rng = np.random.default_rng(1)
    accesses = [str(b) for b in rng.zipf(1.3, size=5000) % 300]
    hits = []
    for capacity in (0, 1, 5, 20, 50, 100, 300):
        lru, hit = BlockLru(capacity), 0
        for block in accesses:
            hit += block in lru
            lru.insert(block)
        hits.append(hit)
    assert hits == sorted(hits) and hits[-1] > hits[0]


def test_more_dram_never_lowers_the_simulated_hit_ratio() -> None:
    requests = conversations(n_conv=30, turns=5, gap_s=15.0, spacing_s=1.0)
    ratios = [
        simulate(requests, SimConfig(dram_gb=gb, gpu_prefix_cache=False), SMALL).hit_ratio.dram
        for gb in (0.0, 0.004, 0.016, 0.032, 0.064, 0.128, 1.0)
    ]
    assert ratios == sorted(ratios)
    assert ratios[0] == 0.0 and ratios[-1] > ratios[1]


@needs_trace
def test_more_dram_never_lowers_hit_ratio_on_the_real_trace() -> None:
    requests = load_requests(CONVERSATION, limit=600)
    ratios = [
        simulate(requests, SimConfig(instances=4, dram_gb=gb)).hit_ratio.total
        for gb in (0, 16, 64, 256)
    ]
    assert ratios == sorted(ratios)


def test_disk_prefetch_only_uses_queue_time() -> None:
    # Each conversation comes back after its blocks left GPU and DRAM (both absent) but while
    # they live on disk. Alone, a request is scheduled at once: no time to prefetch, no disk hit.
    requests = conversations(n_conv=10, turns=3, gap_s=30.0, spacing_s=3.0)
    disk = DiskConfig("essd_pl3", ttl_s=3600, capacity_gb=2000)
    config = SimConfig(gpu_prefix_cache=False, disk=disk)
    idle = simulate(requests, config, SMALL)
    assert idle.hit_ratio.disk == 0.0
    # Same requests in bursts: later ones wait behind earlier ones and get their prefix from disk.
    burst = [r._replace(arrival_s=round(r.arrival_s / 30.0) * 30.0) for r in requests]
    slow = dataclasses.replace(SMALL, prefill_per_token_s=5e-3)
    busy = simulate(burst, config, slow)
    assert busy.hit_ratio.disk > 0.1


def test_timeout_prefetch_policy_holds_a_request_until_its_blocks_are_loaded() -> None:
    # SGLang 0.5.23's default: an idle instance waits for the prefetch instead of recomputing.
    requests = conversations(n_conv=10, turns=3, gap_s=30.0, spacing_s=3.0)
    disk = DiskConfig("essd_pl3", ttl_s=3600, capacity_gb=2000, prefetch_policy="timeout")
    config = SimConfig(gpu_prefix_cache=False, disk=disk)
    held = simulate(requests, config, SMALL)
    # Every returning turn finds the previous turn's blocks (all but its two new ones) on disk.
    later_turns = [r for r in requests if len(r.blocks) > 4]
    returning = sum(len(r.blocks) - 2 for r in later_turns) / sum(len(r.blocks) for r in requests)
    assert held.hit_ratio.disk == pytest.approx(returning)
    # The load time (here ~ ms per block on PL3) is paid in TTFT instead of the recompute.
    best_effort = simulate(
        requests,
        SimConfig(
            gpu_prefix_cache=False, disk=DiskConfig("essd_pl3", ttl_s=3600, capacity_gb=2000)
        ),
        SMALL,
    )
    assert held.mean_ttft_s < best_effort.mean_ttft_s
    # A deadline shorter than the load keeps only what arrived in time.
    slow = dataclasses.replace(SMALL, disk_bytes_s=SMALL.block_bytes * 4.0)  # 4 blocks/s
    cut = dataclasses.replace(
        disk,
        prefetch_timeout_base_s=0.5,
        prefetch_timeout_per_ki_token_s=0.0,
        max_write_backlog_s=1e6,  # keep every write: only the read deadline should cut
    )
    partial = simulate(requests, dataclasses.replace(config, disk=cut), slow)
    assert 0 < partial.hit_ratio.disk < held.hit_ratio.disk
    # Below the prefetch threshold nothing is prefetched.
    high = dataclasses.replace(disk, prefetch_threshold_tokens=10**9)
    assert simulate(requests, dataclasses.replace(config, disk=high), SMALL).hit_ratio.disk == 0.0


def test_ttl_disk_tier_expires_and_refreshes_with_the_shared_policy() -> None:
    policy = TtlPolicy(TtlTable(default_ttl=10.0))
    tier = DiskTier(100, IoChannel(1e9), 1000, policy, max_write_backlog_s=1.0)
    assert tier.write("a", 0.0)
    assert tier.live("a", 10.0)  # live while now <= expiry, as TtlPolicy defines
    assert not tier.live("a", 10.5)
    tier.write("b", 0.0)
    assert tier.touch("b", 8.0)  # refresh on access
    assert tier.live("b", 17.0) and not tier.live("b", 18.5)


def test_lru_disk_evicts_oldest_and_ttl_disk_drops_when_full() -> None:
    lru = DiskTier(2, IoChannel(1e9), 1000, None, max_write_backlog_s=1.0)
    for block in "abc":
        lru.write(block, 0.0)
    assert not lru.live("a", 1.0) and lru.live("c", 1.0)
    ttl = DiskTier(2, IoChannel(1e9), 1000, TtlPolicy(TtlTable(100.0)), max_write_backlog_s=1.0)
    assert ttl.write("a", 0.0) and ttl.write("b", 0.0)
    assert not ttl.write("c", 1.0) and ttl.writes_dropped == 1
    assert ttl.write("c", 200.0)  # expired blocks make room


def test_shared_channel_drops_writes_beyond_the_backlog() -> None:
    channel = IoChannel(1000.0)  # 1 block/s
    tier = DiskTier(100, channel, 1000, TtlPolicy(TtlTable(100.0)), max_write_backlog_s=2.0)
    written = [tier.write(str(i), 0.0) for i in range(6)]
    assert written == [True, True, True, False, False, False]  # 3 s of backlog > 2 s
    assert not tier.live("2", 2.5) and tier.live("2", 3.0)  # readable once written


def test_ttl_peak_occupancy_by_hand() -> None:
    requests = [
        SimRequest(0.0, 100, 1, ("a", "b")),
        SimRequest(5.0, 100, 1, ("a",)),
        SimRequest(30.0, 100, 1, ("c",)),
    ]
    assert ttl_peak_blocks(requests, 10.0) == 2  # a and b together; c alone later
    assert ttl_peak_blocks(requests, 100.0) == 3
    assert ttl_peak_blocks(requests, 0.0) == 0


def test_pricing_cliff_is_a_cost_jump() -> None:
    auto = disk_type("essd_auto")
    below, above = auto.usd_per_hour(460), auto.usd_per_hour(461)
    marginal = auto.usd_per_hour(460) - auto.usd_per_hour(459)
    assert above - below > 50 * marginal
    assert auto.bandwidth_bytes_s(461) > auto.bandwidth_bytes_s(460)
    # The same cliff reaches the simulated bill.
    requests = conversations(n_conv=5, turns=2)
    costs = [
        simulate(
            requests,
            SimConfig(disk=DiskConfig("essd_auto", "lru", capacity_gb=gb)),
            SMALL,
        ).cost.usd_per_hour
        for gb in (459, 460, 461)
    ]
    assert costs[2] - costs[1] > 50 * (costs[1] - costs[0])


def test_cost_counts_gpu_hours_dram_and_disk() -> None:
    requests = conversations(n_conv=5, turns=2)
    base = simulate(requests, SimConfig(instances=2), SMALL)
    hours = base.makespan_s / 3600
    assert base.cost.gpu_usd == pytest.approx(2 * 3.0 * hours)
    more = simulate(requests, SimConfig(instances=2, dram_gb=100), SMALL)
    assert more.cost.usd_per_hour == pytest.approx(base.cost.usd_per_hour + 2 * 100 * 0.004)


def test_decode_series_and_budget_match_a_step_by_step_sum() -> None:
    p = Profile()
    steps = [p.decode_steps_s(8, 1000 + 8 * j, 1) for j in range(50)]
    assert p.decode_steps_s(8, 1000, 50) == pytest.approx(sum(steps))
    budget = sum(steps[:20]) + steps[20] / 2
    assert p.decode_steps_within(8, 1000, budget) == 20


def test_calibration_recovers_coefficients() -> None:
    truth = Profile(
        prefill_base_s=0.01, prefill_per_token_s=5e-5, prefill_attn_per_token_ctx_s=3e-9
    )
    truth = dataclasses.replace(truth, decode_base_s=0.008, decode_per_seq_s=1e-4)
    prefill = [
        PrefillSample(n, c, truth.prefill_base_s + truth.prefill_compute_s(n, c))
        for n in (256, 1024, 4096, 8192)
        for c in (0, 2048, 16384)
    ]
    decode = [
        DecodeSample(b, ctx, truth.decode_steps_s(b, ctx, 1))
        for b in (1, 8, 32)
        for ctx in (1000, 50_000, 200_000)
    ]
    fitted = fit_profile(prefill, decode)
    for name in ("prefill_per_token_s", "prefill_attn_per_token_ctx_s", "decode_per_ctx_token_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-4)


def test_bad_input_gets_clear_errors(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    good = {"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}
    trace.write_text(json.dumps(good) + "\n" + '{"timestamp": 5, "input_length": -3}\n')
    with pytest.raises(TraceError, match=r"t.jsonl:2: .*missing field"):
        load_requests(trace)
    trace.write_text(json.dumps({**good, "input_length": -3}) + "\n")
    with pytest.raises(TraceError, match="input_length"):
        load_requests(trace)
    with pytest.raises(ValueError, match="DRAM capacity"):
        SimConfig(dram_gb=-1)
    with pytest.raises(ValueError, match="disk capacity"):
        DiskConfig(capacity_gb=-5)
    with pytest.raises(ValueError, match="unknown disk type 'floppy'.*essd_pl1"):
        DiskConfig("floppy")
    with pytest.raises(ValueError, match="unknown profile field"):
        Profile.from_mapping({"prefill_speed": 1})
    with pytest.raises(ValueError, match="empty trace"):
        simulate([], SimConfig())


def test_dram_capacity_is_per_instance_in_blocks() -> None:
    # 1 GB of DRAM holds floor(1e9 / 1 MiB) blocks of the small profile.
    assert int(1.0 * GB // SMALL.block_bytes) == 953
