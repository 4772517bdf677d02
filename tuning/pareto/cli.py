"""`python -m sglang_hicache_ext.tuning.pareto`: search the storage configuration space of a trace, write the
frontier (JSON + PNG) and print the configurations meeting the constraints."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from sglang_hicache_ext.tuning.cost import DISK_TYPES
from sglang_hicache_ext.tuning.pareto.adaptive import adaptive_search
from sglang_hicache_ext.tuning.pareto.evaluator import Evaluator, Workload
from sglang_hicache_ext.tuning.pareto.frontier_file import write_frontier
from sglang_hicache_ext.tuning.pareto.grid import grid_search
from sglang_hicache_ext.tuning.pareto.plan import DEFAULT_DISKS, adaptive_settings, grid_space
from sglang_hicache_ext.tuning.pareto.select import Constraints, closest_miss, describe, select
from sglang_hicache_ext.tuning.sim.profile import Profile
from sglang_hicache_ext.tuning.trace import TraceError

INFEASIBLE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hicache-ext-pareto", description=__doc__)
    parser.add_argument("--trace", required=True, type=Path, help="JSONL request trace")
    parser.add_argument("--instances", required=True, type=int, help="serving instances (GPUs)")
    parser.add_argument("--search", choices=("adaptive", "grid"), default="adaptive")
    parser.add_argument("--out", required=True, type=Path, help="directory for frontier files")
    parser.add_argument("--workers", type=int, default=2, help="simulation processes")
    parser.add_argument("--limit", type=int, default=None, help="use the first N requests")
    parser.add_argument("--profile", type=Path, default=None, help="Profile JSON overrides")
    parser.add_argument("--dram-max-gb", type=float, default=1024.0, help="per instance")
    parser.add_argument("--dram-step-gb", type=float, default=64.0)
    parser.add_argument("--ttl-max-s", type=float, default=1800.0)
    parser.add_argument("--ttl-step-s", type=float, default=300.0)
    parser.add_argument(
        "--disks",
        default=",".join(DEFAULT_DISKS),
        help=f"comma-separated disk types among {', '.join(sorted(DISK_TYPES))}",
    )
    parser.add_argument("--max-p99-ttft-ms", type=float, default=float("inf"))
    parser.add_argument("--max-mean-ttft-ms", type=float, default=float("inf"))
    parser.add_argument("--min-throughput", type=float, default=0.0, help="tokens/s")
    parser.add_argument("--max-cost-per-hour", type=float, default=float("inf"), help="USD/h")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (OSError, TraceError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return INFEASIBLE


def _run(args: argparse.Namespace) -> int:
    constraints = Constraints(
        max_p99_ttft_ms=args.max_p99_ttft_ms,
        max_mean_ttft_ms=args.max_mean_ttft_ms,
        min_throughput_tok_s=args.min_throughput,
        max_cost_per_hour=args.max_cost_per_hour,
    )
    profile = Profile.from_json(args.profile) if args.profile else Profile()
    disks = tuple(d.strip() for d in args.disks.split(",") if d.strip())
    space = grid_space(args.dram_max_gb, args.dram_step_gb, args.ttl_max_s, args.ttl_step_s, disks)
    workload = Workload(args.trace, args.instances, args.limit, profile)
    started = time.perf_counter()
    # The grid's size is known; the adaptive search's is not (it stops when nothing is refined).
    total = len(space.grid()) if args.search == "grid" else None
    with (
        tqdm(total=total, desc=f"{args.search} search", unit="sim", disable=None) as bar,
        Evaluator(workload, args.workers, progress=bar.update) as evaluator,
    ):
        if args.search == "grid":
            evaluated = grid_search(space, evaluator)
        else:
            evaluated = adaptive_search(adaptive_settings(space), evaluator)
    elapsed = time.perf_counter() - started
    meta = {"trace": str(args.trace), "instances": args.instances, "search": args.search}
    frontier = write_frontier(evaluated, args.out, {**meta, "seconds": round(elapsed, 1)})
    print(
        f"{args.search} search: {len(evaluated)} simulations in {elapsed:.0f} s, "
        f"{len(frontier)} non-dominated; wrote {args.out / 'frontier.json'} and frontier.png"
    )
    chosen = select(frontier, constraints)
    if not chosen:
        print(
            f"infeasible: no non-dominated configuration meets {constraints.describe()} "
            f"({closest_miss(frontier, constraints)})",
            file=sys.stderr,
        )
        return INFEASIBLE
    print(f"{len(chosen)} configuration(s) meet {constraints.describe()}, cheapest first:")
    for evaluation in chosen:
        print(describe(evaluation, profile))
    return 0
