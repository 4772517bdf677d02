"""Trace replay (DRAM LRU + TTL disk, one shared TTL policy) and the replay CLI."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from sglang_hicache_ext.radix.access_recorder import AccessRecorder
from sglang_hicache_ext.radix.groups import SubtreeGrouping
from sglang_hicache_ext.tiers.pages.ttl_policy import TtlPolicy, TtlTable
from sglang_hicache_ext.tuning.trace import TraceRequest, load_trace
from sglang_hicache_ext.tuning.ttl.cli import main
from sglang_hicache_ext.tuning.ttl.planner import (
    FixedTtlPlanner,
    GroupTtlPlanner,
    PlannedTtls,
    TtlPlanner,
)
from sglang_hicache_ext.tuning.ttl.replay import ReplayConfig, replay


class ConstantPlanner(TtlPlanner):
    name = "constant"

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self.windows: list[tuple[float, float]] = []

    def plan(
        self, recorder: AccessRecorder, start_s: float, end_s: float, budget_pages: float
    ) -> PlannedTtls:
        self.windows.append((start_s, end_s))
        return PlannedTtls(TtlTable(self.ttl), SubtreeGrouping(), "constant")


def requests(*items: tuple[float, str]) -> list[TraceRequest]:
    return [TraceRequest(t, tuple(pages.split())) for t, pages in items]


def test_policy_expiry_and_refresh() -> None:
    policy = TtlPolicy(TtlTable(default_ttl=10.0, ttls={"hot": 100.0}))
    assert policy.expiry_on_access("hot", 5.0) == 105.0
    assert policy.expiry_on_access("anything-else", 5.0) == 15.0
    assert policy.is_live(15.0, 15.0) and not policy.is_live(15.0, 15.001)
    policy.update(TtlTable(default_ttl=1.0))
    assert policy.expiry_on_access("hot", 5.0) == 6.0
    with pytest.raises(ValueError):
        TtlTable(default_ttl=-1.0)


def test_disk_hits_and_bytes_hand_computed() -> None:
    trace = requests((0.0, "a"), (5.0, "a"), (20.0, "a b"), (24.0, "b"))
    config = ReplayConfig(bytes_per_block=2, disk_budget_bytes=0.0)
    result = replay(trace, ConstantPlanner(10.0), config)
    # a: 0 miss, 5 hit (5 <= 10), 20 miss (15 > 10); b: 20 miss, 24 hit.
    assert (result.accesses, result.disk_hits, result.dram_hits) == (5, 2, 0)
    # Residency: a [0,5) + [5,15) + [20,24], b [20,24) + [24,24]: 15 + 4 + 4 = 23 page-s / 24 s.
    assert result.avg_disk_bytes == pytest.approx(2 * 23 / 24)
    assert result.peak_disk_bytes == 4  # a and b together in [20, 24)


def test_dram_tier_in_front_of_write_through_disk() -> None:
    trace = requests((0.0, "a"), (1.0, "b"), (2.0, "a"), (3.0, "a"))
    config = ReplayConfig(bytes_per_block=10, disk_budget_bytes=0.0, dram_bytes=15.0)
    result = replay(trace, ConstantPlanner(10.0), config)
    # DRAM holds one page: a evicted by b, so a at t=2 comes from disk, a at t=3 from DRAM.
    assert (result.dram_hits, result.disk_hits, result.misses) == (1, 1, 2)
    assert result.to_json()["hit_ratio"] == {"dram": 0.25, "disk": 0.25, "total": 0.5, "miss": 0.5}


def test_online_plans_only_from_earlier_periods() -> None:
    trace = requests(*[(float(t), f"S c{t % 3}") for t in range(0, 100, 5)])
    planner = ConstantPlanner(7.0)
    config = ReplayConfig(
        bytes_per_block=1, disk_budget_bytes=1.0, online=True, period_s=30.0, initial_ttl_s=2.0
    )
    result = replay(trace, planner, config)
    assert planner.windows == [(0.0, 30.0), (0.0, 60.0), (0.0, 90.0)]
    assert [p.start_s for p in result.periods] == [0.0, 30.0, 60.0, 90.0]
    assert result.periods[0].planned.table.default_ttl == 2.0
    assert all(p.planned_from_s[1] == p.start_s for p in result.periods[1:])


def synthetic_trace() -> list[TraceRequest]:
    """Shared block S; conversation h is re-asked every 40 s, one-off conversations never."""
    items = []
    for t in range(0, 1200, 10):
        items.append((float(t), f"S once{t}"))
        if t % 40 == 0:
            items.append((t + 0.5, "S h h.1 h.2"))
    return requests(*items)


def test_group_policy_uses_the_budget_and_beats_fixed_on_planted_trace() -> None:
    trace = synthetic_trace()
    config = ReplayConfig(bytes_per_block=1, disk_budget_bytes=5.0)
    fixed = replay(trace, FixedTtlPlanner(3600.0), config)
    group = replay(trace, GroupTtlPlanner(top_k=1, max_ttl_s=3600.0), config)
    assert group.periods[0].planned.choice == "group"
    assert group.avg_disk_bytes <= 5.0 * 1.01 and fixed.avg_disk_bytes <= 5.0 * 1.01
    # One TTL >= 40 s for h would also keep every one-off page 40 s: far over budget. Group
    # TTLs keep h for 40 s and drop the one-offs at once.
    assert group.disk_hits > fixed.disk_hits
    assert group.periods[0].planned.table.ttl("subtree:h") >= 40.0


def test_replay_reports_progress_without_changing_the_result() -> None:
    trace = requests(*[(float(t), f"S c{t % 7}") for t in range(3000)])
    config = ReplayConfig(bytes_per_block=1, disk_budget_bytes=3.0, online=True, period_s=500.0)
    reported: list[int] = []
    with_progress = replay(trace, FixedTtlPlanner(3600.0), config, progress=reported.append)
    assert sum(reported) == len(trace) and max(reported) <= 1024
    assert with_progress == replay(trace, FixedTtlPlanner(3600.0), config)


def test_trace_loader_skips_malformed_lines(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(
        '{"timestamp": 2000, "hash_ids": [0, 2]}\n'
        "not json\n"
        '{"timestamp": -1, "hash_ids": [0]}\n'
        '{"timestamp": 0, "hash_ids": [0, 1]}\n'
        '{"hash_ids": [0]}\n'
    )
    trace = load_trace(path)
    assert trace.skipped_lines == 3
    assert trace.requests == requests((0.0, "0 1"), (2.0, "0 2"))


def run_cli(*argv: str) -> dict:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(list(argv)) == 0
    return json.loads(out.getvalue())


def test_cli_replay_prints_json(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    lines = [
        json.dumps({"timestamp": r.time_s * 1000, "hash_ids": r.pages}) for r in synthetic_trace()
    ]
    path.write_text("\n".join(lines) + "\nbroken line\n")
    common = ["replay", "--trace", str(path), "--block-tokens", "1", "--bytes-per-token", "1"]
    offline = run_cli(*common, "--disk-budget-gb", "12e-9", "--policy", "fixed")
    assert offline["skipped_lines"] == 1 and offline["bytes_per_block"] == 1
    assert offline["avg_disk_bytes"] <= 12.0 * 1.01
    assert set(offline["hit_ratio"]) == {"dram", "disk", "total", "miss"}
    online = run_cli(*common, "--disk-budget-gb", "12e-9", "--online", "--period", "300")
    assert [p["start_s"] for p in online["ttls"]] == [0.0, 300.0, 600.0, 900.0]
    with pytest.raises(SystemExit):
        main([*common, "--disk-budget-gb", "-1"])


def test_group_planner_with_one_group_gives_the_fixed_ttl() -> None:
    # No shared prefix and K = 0: every page is in the residual group (the shared-prefix group is
    # empty and free), so the group optimiser must land on the single-TTL solution.
    recorder = AccessRecorder()
    for request in synthetic_trace():
        recorder.record_request(request.time_s, request.pages[1:])  # drop the shared block
    group = GroupTtlPlanner(top_k=0, max_ttl_s=3600.0, validation_fraction=0.0)
    fixed = FixedTtlPlanner(3600.0)
    group_table = group.plan(recorder, 0.0, 1200.0, budget_pages=3.0).table
    fixed_table = fixed.plan(recorder, 0.0, 1200.0, budget_pages=3.0).table
    assert group_table.default_ttl == pytest.approx(fixed_table.default_ttl, rel=1e-6)
    assert 0.0 < fixed_table.default_ttl < 3600.0
