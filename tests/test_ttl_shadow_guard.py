"""The simulated disk (shared by the replay and the shadows) and the shadow-guarded planner."""

from __future__ import annotations

import math

import pytest

from sglang_hicache_ext.tuning.trace import TraceRequest, parse_block_request
from sglang_hicache_ext.tuning.ttl.planner import FixedTtlPlanner, GroupTtlPlanner
from sglang_hicache_ext.tuning.ttl.replay import ReplayConfig, replay
from sglang_hicache_ext.tuning.ttl.shadow_guard import ShadowGuardPlanner
from sglang_hicache_ext.tuning.ttl.simulated_disk import SimulatedDisk
from sglang_hicache_ext.tuning.ttl.synth import generate, shape_named


def test_simulated_disk_hits_until_expiry_inclusive() -> None:
    disk = SimulatedDisk(keep_segments=True)
    assert not disk.access("a", expiry=10.0, now=0.0)  # first write: a miss
    assert disk.access("a", expiry=20.0, now=10.0)  # exactly at expiry: still live
    assert not disk.access("a", expiry=40.0, now=20.5)  # past it: a miss
    starts, ends = disk.segments(end_s=100.0)
    assert sorted(zip(starts, ends, strict=True)) == [(0.0, 10.0), (10.0, 20.0), (20.5, 40.0)]


def test_simulated_disk_evicts_the_soonest_expiring_at_capacity() -> None:
    disk = SimulatedDisk(capacity_pages=2)
    disk.access("long", expiry=100.0, now=0.0)
    disk.access("short", expiry=5.0, now=1.0)
    disk.access("new", expiry=50.0, now=2.0)  # full: "short" goes, not the older "long"
    assert disk.evictions == 1
    assert not disk.access("short", expiry=60.0, now=3.0)
    assert disk.access("long", expiry=100.0, now=4.0)


@pytest.mark.parametrize("capacity", [math.inf, 2])
def test_forgetting_expired_pages_changes_no_outcome(capacity: float) -> None:
    disk, twin = SimulatedDisk(capacity), SimulatedDisk(capacity)
    accesses = [("a", 5.0, 0.0), ("b", 50.0, 1.0), ("c", 3.0, 2.0), ("a", 20.0, 10.0)]
    accesses += [("c", 30.0, 11.0), ("b", 60.0, 12.0), ("d", 40.0, 13.0), ("c", 30.0, 14.0)]
    outcomes, twin_outcomes = [], []
    for page, expiry, now in accesses:
        outcomes.append(disk.access(page, expiry, now))
        twin.forget_expired(now)
        twin_outcomes.append(twin.access(page, expiry, now))
    assert outcomes == twin_outcomes and disk.evictions == twin.evictions
    twin.forget_expired(45.0)
    assert len(twin) == 1  # only "b" (expiry 60) is still live
    with pytest.raises(ValueError, match="segments"):
        SimulatedDisk(keep_segments=True).forget_expired(0.0)


def test_a_page_that_expired_and_returns_is_counted_once() -> None:
    disk = SimulatedDisk(capacity_pages=2)
    disk.access("a", expiry=5.0, now=0.0)
    disk.access("b", expiry=50.0, now=1.0)
    disk.access("a", expiry=20.0, now=10.0)  # "a" expired at 5: resident again, not twice
    assert disk.evictions == 0
    disk.access("c", expiry=30.0, now=11.0)  # now three live pages for two places
    assert disk.evictions == 1 and not disk.access("a", expiry=40.0, now=12.0)


def _planners(groups: int = 8) -> tuple[FixedTtlPlanner, GroupTtlPlanner]:
    return FixedTtlPlanner(3600.0), GroupTtlPlanner(
        groups, 3600.0, validation_fraction=0.0, shrink_events=0.0
    )


def _trace(shape: str, duration_s: float) -> list[TraceRequest]:
    return [parse_block_request(r) for r in generate(shape_named(shape, duration_s=duration_s))]


def _config(budget_gb: float) -> ReplayConfig:
    return ReplayConfig(
        bytes_per_block=512 * 131072,
        disk_budget_bytes=budget_gb * 1e9,
        disk_capacity_bytes=2 * budget_gb * 1e9,
        online=True,
        period_s=60.0,
        history_s=1200.0,
    )


def test_a_guard_between_identical_candidates_is_the_baseline_exactly() -> None:
    trace = _trace("chat", 900.0)
    fixed = replay(trace, FixedTtlPlanner(3600.0), _config(5.0))
    guard = ShadowGuardPlanner([FixedTtlPlanner(3600.0), FixedTtlPlanner(3600.0)])
    guarded = replay(trace, guard, _config(5.0))
    assert guarded.disk_hits == fixed.disk_hits
    assert {p.planned.choice for p in guarded.periods[1:]} == {"fixed (shadow)"}
    first, second = guard.scores()
    assert first.hits == second.hits > 0 and second.lead == 0.0


@pytest.mark.parametrize(("shape", "budget_gb"), [("uniform", 5.0), ("bursty", 10.0)])
def test_guard_is_never_clearly_worse_than_one_ttl(shape: str, budget_gb: float) -> None:
    trace = _trace(shape, 1800.0)
    fixed = replay(trace, FixedTtlPlanner(3600.0), _config(budget_gb))
    guarded = replay(trace, ShadowGuardPlanner(list(_planners())), _config(budget_gb))
    assert guarded.disk_hits >= 0.99 * fixed.disk_hits


def test_guard_follows_group_ttls_where_groups_differ() -> None:
    trace = _trace("agent", 1800.0)
    config = _config(5.0)
    fixed = replay(trace, FixedTtlPlanner(3600.0), config)
    guard = ShadowGuardPlanner(list(_planners()))
    guarded = replay(trace, guard, config)
    baseline, group = guard.scores()
    assert group.hits > baseline.hits and group.lead > guard.z
    assert any(p.planned.choice == "group" for p in guarded.periods)
    assert guarded.disk_hits > fixed.disk_hits


def test_guard_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match="baseline"):
        ShadowGuardPlanner([FixedTtlPlanner(3600.0)])
    with pytest.raises(ValueError, match="capacity_factor"):
        ShadowGuardPlanner(list(_planners()), capacity_factor=0.5)
    with pytest.raises(ValueError, match="half_life_s"):
        ShadowGuardPlanner(list(_planners()), half_life_s=-1.0)
    with pytest.raises(ValueError, match="backtest_period_s"):
        ShadowGuardPlanner(list(_planners()), backtest_period_s=0.0)
    assert math.isinf(
        ShadowGuardPlanner(list(_planners()), capacity_factor=math.inf).capacity_factor
    )
