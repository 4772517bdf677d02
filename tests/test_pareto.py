"""Pareto filter, hypervolume, adaptive search, selection and the CLI."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest

from sglang_hicache_ext.tuning.cost import CostBreakdown
from sglang_hicache_ext.tuning.pareto.adaptive import AdaptiveSettings, adaptive_search
from sglang_hicache_ext.tuning.pareto.cli import main
from sglang_hicache_ext.tuning.pareto.evaluator import Evaluation, PointEvaluator, objective_matrix
from sglang_hicache_ext.tuning.pareto.front import pareto_mask
from sglang_hicache_ext.tuning.pareto.frontier_file import read_frontier, replot_frontier
from sglang_hicache_ext.tuning.pareto.grid import grid_search
from sglang_hicache_ext.tuning.pareto.hypervolume import hypervolume, reference_point
from sglang_hicache_ext.tuning.pareto.select import Constraints, describe, select, sglang_flags
from sglang_hicache_ext.tuning.pareto.space import NO_DISK, Axis, Point, Space
from sglang_hicache_ext.tuning.sim.profile import Profile
from sglang_hicache_ext.tuning.sim.result import SimResult, TierHits


def test_pareto_filter_by_hand() -> None:
    f = np.array([[1, 1, 1], [2, 2, 2], [1, 2, 0], [1, 1, 1], [0, 3, 3], [1, 3, 3]])
    # [2,2,2] is dominated by [1,1,1]; [1,3,3] by [0,3,3]; duplicates do not dominate each other.
    assert pareto_mask(f).tolist() == [True, False, True, True, True, False]


def test_hypervolume_by_hand() -> None:
    ref = np.array([2.0, 2.0, 2.0])
    assert hypervolume(np.array([[1, 1, 1]]), ref) == pytest.approx(1.0)
    # Two boxes of volume 2 overlapping in a unit cube.
    assert hypervolume(np.array([[0, 1, 1], [1, 0, 1]]), ref) == pytest.approx(3.0)
    # 2x2x1 and 1x1x2 boxes overlapping in a unit cube.
    assert hypervolume(np.array([[0, 0, 1], [1, 1, 0]]), ref) == pytest.approx(5.0)
    # Dominated points and points outside the reference add nothing.
    assert hypervolume(np.array([[1, 1, 1], [1.5, 1.5, 1.5], [3, 0, 0]]), ref) == pytest.approx(1)
    assert hypervolume(np.zeros((0, 3)), ref) == 0.0


def _brute_hypervolume(points: np.ndarray, ref: np.ndarray) -> float:
    """Sum of the grid cells (from all coordinates) that some point dominates."""
    axes = [np.unique(np.append(points[:, k], ref[k])) for k in range(3)]
    volume = 0.0
    for i, j, k in itertools.product(*(range(len(a) - 1) for a in axes)):
        corner = np.array([axes[0][i], axes[1][j], axes[2][k]])
        if (points <= corner).all(axis=1).any():
            volume += np.prod(
                [
                    axes[0][i + 1] - axes[0][i],
                    axes[1][j + 1] - axes[1][j],
                    axes[2][k + 1] - axes[2][k],
                ]
            )
    return volume


def test_hypervolume_matches_brute_force_on_random_sets() -> None:
    rng = np.random.default_rng(3)
    for _ in range(20):
        points = rng.integers(0, 10, size=(rng.integers(1, 9), 3)).astype(float)
        ref = np.array([10.0, 10.0, 10.0])
        assert hypervolume(points, ref) == pytest.approx(_brute_hypervolume(points, ref))


def test_reference_point_is_strictly_worse_than_all() -> None:
    f = np.array([[1.0, -5.0, 3.0], [2.0, -4.0, 3.0]])
    ref = reference_point(f)
    assert (ref > f).all()


def _result(latency: float, throughput: float, cost: float) -> SimResult:
    return SimResult(
        requests=1,
        mean_ttft_s=latency,
        p90_ttft_s=latency * 2,
        p99_ttft_s=latency * 3,
        mean_queue_s=0.0,
        throughput_tok_s=throughput,
        makespan_s=3600.0,
        hit_ratio=TierHits(0.0, 0.0, 0.0),
        disk_gb=0.0,
        disk_bandwidth_mb_s=0.0,
        disk_writes_dropped=0,
        cost=CostBreakdown(cost, 0.0, 0.0, cost),
    )


class Analytic(PointEvaluator):
    """Latency falls steeply then flattens with DRAM; a disk helps a little, more with TTL."""

    def __init__(self, flat_after_gb: float | None = None) -> None:
        self.asked: list[Point] = []
        self.flat_after_gb = flat_after_gb  # DRAM beyond which latency stops improving

    def evaluate(self, points: Iterable[Point]) -> list[Evaluation]:
        out = []
        for p in dict.fromkeys(points):
            self.asked.append(p)
            speed = {"essd_pl1": 0.5, "essd_pl3": 1.0, NO_DISK: 0.0}[p.disk]
            if self.flat_after_gb is None:
                dram_term = 10 * math.exp(-p.dram_gb / 100)
            else:
                dram_term = 10 * max(0.0, 1 - p.dram_gb / self.flat_after_gb)
            latency = 1 + dram_term + 2 / (1 + speed * p.ttl_s / 100)
            cost = 10 + 0.01 * p.dram_gb + speed * p.ttl_s / 1000
            out.append(Evaluation(p, _result(latency, 1000 / latency, cost)))
        return out


def _spaces() -> tuple[Space, AdaptiveSettings]:
    disks = ("essd_pl1", "essd_pl3")
    grid = Space(Axis(0, 1600, 50), Axis(0, 1200, 100), disks)
    coarse = Space(Axis(0, 400, 200), Axis(0, 1200, 400), disks)
    return grid, AdaptiveSettings(coarse, 1600, 50, 100, tau_expand=0.02)


def test_adaptive_search_covers_the_grid_frontier_with_fewer_points() -> None:
    grid_space, settings = _spaces()
    grid = grid_search(grid_space, Analytic())
    evaluator = Analytic()
    adaptive = adaptive_search(settings, evaluator)
    assert len(evaluator.asked) == len(adaptive) == len(set(evaluator.asked))  # each point once
    assert {e.point for e in adaptive} <= set(grid_space.grid())  # refinement stays on the grid
    assert len(adaptive) <= 0.4 * len(grid)
    matrix = np.array([e.objectives for e in [*grid, *adaptive]])
    ref = reference_point(matrix)
    hv = [hypervolume(np.array([e.objectives for e in s]), ref) for s in (grid, adaptive)]
    assert hv[1] >= 0.97 * hv[0]
    # Expansion stopped in the flat tail: latency gain of a 200 GB step there is < 2%.
    top = max(e.point.dram_gb for e in adaptive)
    assert 400 < top < 1600


def test_refinement_adds_midpoints_only_where_metrics_change() -> None:
    _, settings = _spaces()
    flat = AdaptiveSettings(settings.coarse, 400, 50, 100, tau_expand=1.0, tau_perf=10.0)
    assert len(adaptive_search(flat, Analytic())) == len(settings.coarse.grid())
    steep_then_flat = AdaptiveSettings(settings.coarse, 400, 50, 100, tau_expand=1.0)
    drams = {e.point.dram_gb for e in adaptive_search(steep_then_flat, Analytic(200))}
    assert {50.0, 100.0, 150.0} <= drams  # steep region 0..200 refined to the finest step
    assert not {250.0, 300.0, 350.0} & drams  # flat region 200..400 left alone


def test_selection_and_flags(tmp_path: Path) -> None:
    cheap = Evaluation(Point.make(0, 0, "essd_pl1"), _result(5.0, 100, 10))
    fast = Evaluation(
        Point.make(512, 600, "essd_pl3"),
        dataclasses.replace(_result(0.5, 100, 30), disk_gb=1300.0),
    )
    assert cheap.point.disk == NO_DISK
    assert select([cheap, fast], Constraints(max_p99_ttft_ms=2000)) == [fast]
    assert select([cheap, fast], Constraints(max_cost_per_hour=20)) == [cheap]
    assert select([cheap, fast], Constraints(max_p99_ttft_ms=1000)) == []
    flags = sglang_flags(fast, Profile())
    assert flags[flags.index("--hicache-size") + 1] == "512"
    assert flags[flags.index("--hicache-storage-backend") + 1] == "dynamic"
    disk = json.loads(flags[flags.index("--hicache-storage-backend-extra-config") + 1])
    assert disk["class_name"] == "GroupTTLDiskStorage" and disk["initial_ttl_s"] == 600
    assert disk["capacity_bytes"] == 1300e9
    # The printed options are ones our backend accepts (checked like a launch would).
    from sglang_hicache_ext.sglang_ext.config.disk_tier_settings import DiskTierSettings

    assert DiskTierSettings.from_extra_config(disk).ttl_policy == "static"
    # As the CLI prints them: a shell command line that SGLang and the extension accept.
    (line,) = _flag_lines(describe(fast, Profile()))
    assert _server_accepts(line, tmp_path)
    assert "provision: 1300 GB of essd_pl3 at /mnt/essd_pl3" in describe(fast, Profile())
    assert "--hicache-storage-backend" not in sglang_flags(cheap, Profile())


def _synthetic_trace(path: Path) -> None:
    rng = random.Random(0)
    lines = []
    for c in range(30):
        blocks = [0, 1000 + c]
        for t in range(3):
            blocks = [*blocks, 10_000 * (c + 1) + t]
            lines.append(
                {
                    "timestamp": int((c * 4 + t * 40 + rng.random()) * 1000),
                    "input_length": 512 * len(blocks) - 20,
                    "output_length": 50,
                    "hash_ids": blocks,
                }
            )
    lines.sort(key=lambda r: r["timestamp"])
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))


def _cli(trace: Path, out: Path, *extra: str) -> int:
    return main(
        [
            "--trace", str(trace), "--instances", "1", "--out", str(out), "--workers", "1",
            "--dram-max-gb", "8", "--dram-step-gb", "2", "--ttl-max-s", "120", "--ttl-step-s", "60",
            "--disks", "essd_pl1", *extra,
        ]
    )  # fmt: skip


def test_cli_writes_frontier_and_prints_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    _synthetic_trace(trace)
    assert _cli(trace, tmp_path / "out", "--max-cost-per-hour", "100") == 0
    stdout = capsys.readouterr().out
    assert "sglang flags: --radix-cache-backend hicache_ext" in stdout
    # What it prints is a command line SGLang and the extension accept (raises otherwise).
    lines = _flag_lines(stdout)
    assert lines
    for line in lines:
        _server_accepts(line, tmp_path)
    report = json.loads((tmp_path / "out" / "frontier.json").read_text())
    assert report["frontier"] and len(report["frontier"]) <= report["simulations"]
    assert (tmp_path / "out" / "frontier.png").stat().st_size > 1000
    assert _cli(trace, tmp_path / "out", "--search", "grid", "--max-p99-ttft-ms", "0.001") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("infeasible: no non-dominated configuration meets P99 TTFT <= 0.001 ms")
    assert len(err.splitlines()) == 1


def _flag_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "sglang flags:" in line]


def _server_accepts(line: str, tmp_path: Path) -> bool:
    """The flags of one printed configuration, parsed by SGLang's own command line and checked by
    the extension's launch checks (its disk folder moved under `tmp_path`); whether it has a
    disk tier."""
    import argparse
    import shlex

    from sglang.srt.server_args import ServerArgs

    from sglang_hicache_ext.sglang_ext.server.preflight import check_disk_tier, check_settings

    flags = shlex.split(line.split("sglang flags:", 1)[1].split("  (equivalently")[0])
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", str(tmp_path), *flags])
    assert args.radix_cache_backend == "hicache_ext"
    if args.hicache_storage_backend is None:
        return False
    extra = json.loads(args.hicache_storage_backend_extra_config)
    assert extra["disk_dir"].startswith("/mnt/")  # where the printed volume is to be mounted
    extra["disk_dir"] = str(tmp_path / "disk" / Path(extra["disk_dir"]).name)
    args.hicache_storage_backend_extra_config = json.dumps(extra)
    check_settings(args)
    check_disk_tier(args)
    return True


def test_frontier_file_reads_back_what_the_cli_wrote(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    _synthetic_trace(trace)
    assert _cli(trace, tmp_path / "out") == 0
    report = json.loads((tmp_path / "out" / "frontier.json").read_text())
    saved = read_frontier(tmp_path / "out")
    assert saved.meta["instances"] == 1 and saved.meta["search"] == "adaptive"
    assert [e.result.to_json() for e in saved.evaluated] == [
        entry["result"] for entry in report["evaluated"]
    ]
    matrix = objective_matrix(saved.evaluated)
    kept = [e for e, keep in zip(saved.evaluated, pareto_mask(matrix), strict=True) if keep]
    assert saved.frontier == kept
    png = replot_frontier(tmp_path / "out", tmp_path / "again.png")
    assert png.stat().st_size > 1000


def test_cli_reports_bad_trace_and_disk_type(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0}\n')
    assert _cli(trace, tmp_path / "out") == 2
    assert "bad.jsonl:1: malformed trace line" in capsys.readouterr().err
    _synthetic_trace(trace)
    assert _cli(trace, tmp_path / "out", "--disks", "floppy") == 2
    assert "unknown disk type 'floppy'" in capsys.readouterr().err
    assert main(["--trace", str(trace), "--instances", "0", "--out", str(tmp_path)]) == 2
    assert "instances must be >= 1" in capsys.readouterr().err
    assert _cli(trace, tmp_path / "out", "--dram-max-gb", "-8") == 2
    assert "bad axis" in capsys.readouterr().err
