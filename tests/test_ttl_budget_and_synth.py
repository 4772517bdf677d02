"""The disk budget from the first minute (paced TTL, hard capacity, time over budget), warm-up
scoring, the trace generator and the sweep command."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from sglang_hicache_ext.tuning.trace import TraceRequest, load_trace
from sglang_hicache_ext.tuning.ttl.budget import paced_ttl
from sglang_hicache_ext.tuning.ttl.cli import main
from sglang_hicache_ext.tuning.ttl.optimiser import fit_budget
from sglang_hicache_ext.tuning.ttl.planner import FixedTtlPlanner
from sglang_hicache_ext.tuning.ttl.profile import GroupProfile
from sglang_hicache_ext.tuning.ttl.profile_set import ProfileSet
from sglang_hicache_ext.tuning.ttl.replay import ReplayConfig, replay
from sglang_hicache_ext.tuning.ttl.synth import SHAPES, TraceShape, generate, shape_named


def steady_trace(seconds: int = 600, pages_per_request: int = 4) -> list[TraceRequest]:
    """One request per second, each of fresh pages plus a page re-read 5 s later."""
    items = []
    for t in range(seconds):
        pages = [f"p{t}.{i}" for i in range(pages_per_request)]
        if t >= 5:
            pages.append(f"p{t - 5}.0")
        items.append(TraceRequest(float(t), tuple(pages)))
    return items


def test_paced_ttl_is_littles_law() -> None:
    assert paced_ttl(100.0, page_writes=50, elapsed_s=10.0, max_ttl_s=3600.0) == 20.0
    assert paced_ttl(100.0, page_writes=0, elapsed_s=0.0, max_ttl_s=3600.0) == 0.0
    assert paced_ttl(1e9, page_writes=1, elapsed_s=10.0, max_ttl_s=60.0) == 60.0


@pytest.mark.parametrize("initial_ttl_s", [None, 300.0])
def test_first_period_respects_the_budget_only_when_paced(initial_ttl_s: float | None) -> None:
    config = ReplayConfig(
        bytes_per_block=1,
        disk_budget_bytes=40.0,
        online=True,
        period_s=300.0,
        initial_ttl_s=initial_ttl_s,
    )
    result = replay(steady_trace(299), FixedTtlPlanner(3600.0), config)  # first period only
    if initial_ttl_s is None:
        assert result.periods[0].planned.choice == "paced"
        assert result.avg_disk_bytes <= 40.0 and result.peak_disk_bytes <= 2 * 40.0
    else:  # 300 s of 4-5 pages per second: ~1,300 pages against a budget of 40
        assert result.peak_disk_bytes > 20 * 40.0


def test_capacity_caps_the_disk_and_counts_evictions() -> None:
    capped = ReplayConfig(bytes_per_block=1, disk_budget_bytes=40.0, disk_capacity_bytes=80.0)
    uncapped = ReplayConfig(bytes_per_block=1, disk_budget_bytes=40.0)
    planner = FixedTtlPlanner(3600.0, table=None)
    big = replay(steady_trace(), planner, uncapped)
    small = replay(steady_trace(), planner, capped)
    # Offline, the fixed TTL meets the average budget; the capacity bounds the peak as well.
    assert small.peak_disk_bytes <= 80.0 and big.capacity_evictions == 0
    tight = ReplayConfig(bytes_per_block=1, disk_budget_bytes=40.0, disk_capacity_bytes=10.0)
    squeezed = replay(steady_trace(), planner, tight)
    assert squeezed.peak_disk_bytes <= 10.0
    assert squeezed.capacity_evictions > 0 and squeezed.disk_hits < big.disk_hits
    assert squeezed.seconds_over_budget == 0.0


def test_time_over_budget_and_warm_up_scoring() -> None:
    trace = steady_trace(200)
    config = ReplayConfig(bytes_per_block=1, disk_budget_bytes=1.0, online=True, initial_ttl_s=50)
    whole = replay(trace, FixedTtlPlanner(3600.0), config)
    assert whole.seconds_over_budget > 100  # ~200 pages resident against a budget of 1
    late = replay(
        trace,
        FixedTtlPlanner(3600.0),
        ReplayConfig(
            bytes_per_block=1,
            disk_budget_bytes=1.0,
            online=True,
            initial_ttl_s=50,
            score_from_s=100.0,
        ),
    )
    assert late.accesses == sum(len(r.pages) for r in trace if r.time_s >= 100.0)
    assert late.duration_s == pytest.approx(99.0)
    with pytest.raises(ValueError, match="nothing of the trace"):
        replay(trace, FixedTtlPlanner(3600.0), ReplayConfig(1, 1.0, score_from_s=500.0))


def test_fit_budget_survives_denormal_ttls() -> None:
    """SLSQP can leave a TTL at 1e-314, whose scale ceiling overflowed (a crash on a trace)."""
    profiles = [
        GroupProfile.build("a", np.array([5.0, 10.0, 50.0]), 3),
        GroupProfile.build("b", np.array([1.0, 2.0]), 2),
    ]
    groups = ProfileSet(profiles)
    fitted = fit_budget(groups, np.array([10.0, 2.97e-314]), budget=400.0, max_ttl=3600.0)
    assert fitted[1] == 0.0
    assert float(groups.cost(fitted).sum()) <= 400.0
    assert float(groups.cost(fitted).sum()) == pytest.approx(400.0, rel=1e-6)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_generated_traces_are_prefix_paths(name: str) -> None:
    shape = shape_named(name, duration_s=600.0)
    records = generate(shape)
    times = [r["timestamp"] for r in records]
    assert times == sorted(times) and times[-1] < 600_000
    assert abs(len(records) / 600.0 - shape.requests_per_s) < 0.5 * shape.requests_per_s
    shared = list(range(shape.shared_blocks))
    parents: dict[int, tuple[int, ...]] = {}
    for record in records:
        path = record["hash_ids"]
        assert path[: shape.shared_blocks] == shared and len(path) <= shape.max_blocks
        # Mooncake ids name a whole prefix: an id always follows the same prefix.
        for i, block in enumerate(path):
            assert parents.setdefault(block, tuple(path[:i])) == tuple(path[:i])
    assert generate(shape) == records  # seeded


def test_generator_knobs_change_what_they_say() -> None:
    flat = generate(TraceShape(duration_s=900.0, apps=20, app_skew=0.0, seed=4))
    skewed = generate(TraceShape(duration_s=900.0, apps=20, app_skew=2.0, seed=4))

    def top_app_share(records: list[dict]) -> float:
        apps = [r["hash_ids"][1] for r in records]
        return max(apps.count(a) for a in set(apps)) / len(apps)

    assert top_app_share(skewed) > 2 * top_app_share(flat)
    with pytest.raises(ValueError, match="apps"):
        TraceShape(apps=0)
    with pytest.raises(ValueError, match="unknown trace shape"):
        shape_named("nope")


def test_synth_and_sweep_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "uniform.jsonl"
    assert main(["synth", "--shape", "uniform", "--duration-s", "900", "--out", str(trace)]) == 0
    assert len(load_trace(trace).requests) > 500
    out = tmp_path / "sweep.json"
    args = ["sweep", "--trace", str(trace), "--budgets-gb", "5,50", "--period", "300"]
    assert main([*args, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [row["budget_gb"] for row in report["rows"]] == [5.0, 50.0]
    for row in report["rows"]:
        for policy in ("fixed", "group", "group+fallback"):
            assert row[policy]["peak_over_budget"] <= 2.0  # the live tier's capacity
        assert row["fixed"]["hit_ratio"]["disk"] > 0
    assert (
        report["rows"][1]["fixed"]["hit_ratio"]["disk"]
        > report["rows"][0]["fixed"]["hit_ratio"]["disk"]
    )
    bad_inputs = {
        "must be numbers > 0": ["--budgets-gb", "-5"],
        "unknown TTL policy 'lru'": ["--budgets-gb", "5", "--policies", "lru"],
    }
    for message, bad in bad_inputs.items():
        with pytest.raises(SystemExit) as stop:
            main(["sweep", "--trace", str(trace), *bad])
        assert stop.value.code == 2 and message in capsys.readouterr().err
    assert math.isfinite(report["rows"][0]["fixed"]["seconds_over_budget"])
