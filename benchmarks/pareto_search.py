"""Adaptive Pareto search vs the plain grid on the conversation trace (Kareto §5.3.1).

For each instance count: run the adaptive search, then the grid (sharing simulation results, so
the grid only simulates what the adaptive search did not), compute both hypervolumes against one
reference point built from every simulated configuration, and time one full-trace simulation on
one core. Writes benchmarks/results/pareto_search.json, the adaptive frontier (JSON + PNG) under
benchmarks/results/pareto_<N>/, and prints a Markdown table for docs/simulator.md.

    .venv/bin/python -m benchmarks.pareto_search [--instances 1 4] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.shared_data import CONVERSATION_TRACE
from sglang_hicache_ext.tuning.pareto.adaptive import adaptive_search
from sglang_hicache_ext.tuning.pareto.evaluator import Evaluator, Workload, objective_matrix
from sglang_hicache_ext.tuning.pareto.front import pareto_mask
from sglang_hicache_ext.tuning.pareto.frontier_file import write_frontier
from sglang_hicache_ext.tuning.pareto.grid import grid_search
from sglang_hicache_ext.tuning.pareto.hypervolume import hypervolume, reference_point
from sglang_hicache_ext.tuning.pareto.plan import adaptive_settings, grid_space
from sglang_hicache_ext.tuning.pareto.space import Point
from sglang_hicache_ext.tuning.sim.simulator import simulate
from sglang_hicache_ext.tuning.trace import load_requests

RESULTS = Path(__file__).resolve().parent / "results"


def compare(trace: Path, instances: int, workers: int, limit: int | None) -> dict[str, Any]:
    space = grid_space()
    settings = adaptive_settings(space)
    # The adaptive points are a subset of the grid, so the grid's size is the total.
    with (
        tqdm(
            total=len(space.grid()), desc=f"{instances} instance(s)", unit="sim", disable=None
        ) as bar,
        Evaluator(Workload(trace, instances, limit), workers, progress=bar.update) as evaluator,
    ):
        started = time.perf_counter()
        adaptive = adaptive_search(settings, evaluator)
        adaptive_s = time.perf_counter() - started
        tqdm.write(f"{instances} instance(s): adaptive {len(adaptive)} sims in {adaptive_s:.0f} s")
        grid = grid_search(space, evaluator)
        total_s = time.perf_counter() - started
    union = objective_matrix([*grid, *adaptive])
    reference = reference_point(union)
    hv = {}
    for name, evaluated in (("grid", grid), ("adaptive", adaptive)):
        matrix = objective_matrix(evaluated)
        hv[name] = hypervolume(matrix[pareto_mask(matrix)], reference)
    write_frontier(
        adaptive,
        RESULTS / f"pareto_{instances}",
        {"trace": trace.name, "instances": instances, "search": "adaptive"},
    )
    return {
        "instances": instances,
        "grid_simulations": len(grid),
        "adaptive_simulations": len(adaptive),
        "simulation_ratio": len(adaptive) / len(grid),
        "reference_point": reference.tolist(),
        "hypervolume_grid": hv["grid"],
        "hypervolume_adaptive": hv["adaptive"],
        "hypervolume_ratio": hv["adaptive"] / hv["grid"],
        "adaptive_wall_s": round(adaptive_s, 1),
        "grid_and_adaptive_wall_s": round(total_s, 1),
        "workers": workers,
        "adaptive_settings": {
            "coarse_dram_gb": settings.coarse.dram.values(),
            "coarse_ttl_s": settings.coarse.ttl.values(),
            "tau_expand": settings.tau_expand,
            "tau_perf": settings.tau_perf,
            "tau_cost": settings.tau_cost,
        },
        "grid": {
            "dram_gb": space.dram.values(),
            "ttl_s": space.ttl.values(),
            "disks": list(space.disks),
        },
    }


def time_one(trace: Path, instances: int, limit: int | None) -> float:
    """Wall seconds of one full simulation in this process (one core): the heaviest corner."""
    requests = load_requests(trace, limit)
    config = Point.make(1024, 1800, "essd_pl3").sim_config(instances)
    started = time.perf_counter()
    simulate(requests, config)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trace", type=Path, default=CONVERSATION_TRACE)
    parser.add_argument("--instances", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args()
    if not args.trace.is_file():
        sys.exit(f"trace {args.trace} not found (expected shared/ beside the repository)")
    rows = []
    for n in args.instances:
        row = compare(args.trace, n, args.workers, args.limit)
        row["one_simulation_s"] = round(time_one(args.trace, n, args.limit), 2)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not isinstance(v, dict)}), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"trace": args.trace.name, "requests": len(load_requests(args.trace, args.limit))}
    (RESULTS / "pareto_search.json").write_text(json.dumps({**out, "runs": rows}, indent=1) + "\n")
    print("| instances | grid sims | adaptive sims | sims ratio | HV ratio | one sim (s) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['instances']} | {r['grid_simulations']} | {r['adaptive_simulations']} | "
            f"{r['simulation_ratio']:.0%} | {r['hypervolume_ratio']:.4f} | {r['one_simulation_s']} |"
        )


if __name__ == "__main__":
    main()
