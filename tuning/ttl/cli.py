"""`python -m sglang_hicache_ext.tuning.ttl`: `replay` a trace under a disk budget (JSON out),
`synth` a trace, `sweep` the disk hit ratio over budgets per policy."""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

from tqdm import tqdm

from sglang_hicache_ext.tuning.trace import TraceRequest, load_trace
from sglang_hicache_ext.tuning.ttl.planner import FixedTtlPlanner, GroupTtlPlanner, TtlPlanner
from sglang_hicache_ext.tuning.ttl.replay import (
    DEFAULT_BYTES_PER_TOKEN,
    ReplayConfig,
    ReplayResult,
    replay,
)
from sglang_hicache_ext.tuning.ttl.shadow_guard import ShadowGuardPlanner
from sglang_hicache_ext.tuning.ttl.sweep import CAPACITY_FACTOR, POLICIES, planner_named, sweep
from sglang_hicache_ext.tuning.ttl.synth import SHAPES, TraceShape, shape_named, write_trace

GB = 1e9


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hicache-ext-ttl")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("replay", help="replay a trace through DRAM + TTL disk tiers")
    run.add_argument("--trace", required=True, help="JSONL trace (timestamp ms, hash_ids)")
    run.add_argument(
        "--block-tokens",
        type=int,
        default=512,
        help="tokens per hash id in the trace (512 for the Mooncake traces)",
    )
    run.add_argument(
        "--bytes-per-token",
        type=int,
        default=DEFAULT_BYTES_PER_TOKEN,
        help="KV bytes per token; default 131072 = Llama-3-8B-like fp16 "
        "(32 layers x K,V x 8 KV heads x 128 dim x 2 B), i.e. 64 MiB per 512-token block",
    )
    run.add_argument(
        "--disk-budget-gb", type=float, required=True, help="average disk bytes, GB (1e9)"
    )
    run.add_argument("--dram-gb", type=float, default=0.0, help="DRAM LRU tier, GB (0: none)")
    run.add_argument(
        "--policy",
        choices=("group", "fixed"),
        default="group",
        help="group: group TTLs while their shadow disk out-earns one TTL's (the live default)",
    )
    run.add_argument("--groups", type=int, default=32, help="K: top subtrees given own TTL")
    run.add_argument("--online", action="store_true", help="re-plan every period from the past")
    run.add_argument("--period", type=float, default=120.0, help="online period, seconds")
    run.add_argument(
        "--history", type=float, default=2400.0, help="online: seconds of past used to plan"
    )
    run.add_argument(
        "--initial-ttl",
        type=float,
        default=None,
        help="online: TTL of the first period (default: paced from the budget and write rate)",
    )
    run.add_argument(
        "--score-from",
        type=float,
        default=0.0,
        help="seconds of the trace replayed as warm-up (planner history) but not scored",
    )
    run.add_argument("--max-ttl", type=float, default=3600.0, help="upper bound on any TTL")
    run.add_argument(
        "--no-validation",
        action="store_true",
        help="group policy: always publish group TTLs (no shadow check against one TTL)",
    )
    run.add_argument("--seed", type=int, default=0, help="seed of the multi-start perturbations")
    run.add_argument(
        "--capacity-gb",
        type=float,
        default=None,
        help="hard disk capacity, GB (default: uncapped; the live tier uses 2x the budget)",
    )

    synth = commands.add_parser("synth", help="write a synthetic Mooncake-style trace (JSONL)")
    synth.add_argument("--out", required=True, help="JSONL file to write")
    synth.add_argument("--shape", choices=sorted(SHAPES), default="chat", help="preset knobs")
    for knob in fields(TraceShape):
        synth.add_argument(
            f"--{knob.name.replace('_', '-')}",
            type=type(knob.default),
            default=None,
            help=f"override the shape's {knob.name}",
        )

    sweep = commands.add_parser("sweep", help="disk hit ratio vs budget per TTL policy")
    sweep.add_argument("--trace", required=True, help="JSONL trace (timestamp ms, hash_ids)")
    sweep.add_argument("--budgets-gb", required=True, help="comma-separated average budgets, GB")
    sweep.add_argument("--policies", default=",".join(POLICIES))
    sweep.add_argument("--score-from", type=float, default=0.0, help="warm-up seconds, unscored")
    sweep.add_argument("--block-tokens", type=int, default=512)
    sweep.add_argument("--bytes-per-token", type=int, default=DEFAULT_BYTES_PER_TOKEN)
    sweep.add_argument("--groups", type=int, default=32)
    sweep.add_argument("--period", type=float, default=120.0)
    sweep.add_argument("--history", type=float, default=2400.0)
    sweep.add_argument("--max-ttl", type=float, default=3600.0)
    sweep.add_argument(
        "--capacity-factor",
        type=float,
        default=CAPACITY_FACTOR,
        help="hard disk capacity as a multiple of the budget, as the live disk tier "
        "(default 2; inf: uncapped)",
    )
    sweep.add_argument("--out", default=None, help="JSON file (default: stdout)")
    return parser


def synth_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    overrides = {
        knob.name: getattr(args, knob.name)
        for knob in fields(TraceShape)
        if getattr(args, knob.name) is not None
    }
    try:
        shape = shape_named(args.shape, **overrides)
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    count = write_trace(shape, args.out)
    print(f"{count} requests ({args.shape}) -> {args.out}", file=sys.stderr)
    return 0


def sweep_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        budgets = [float(b) for b in args.budgets_gb.split(",")]
        policies = args.policies.split(",")
        for name in policies:
            planner_named(name, args.groups, args.max_ttl)
    except ValueError as error:
        parser.error(str(error))
    if not budgets or any(not (math.isfinite(b) and b > 0) for b in budgets):
        parser.error("--budgets-gb must be numbers > 0")
    try:
        trace = load_trace(args.trace)
    except OSError as error:
        parser.error(f"cannot read trace: {error}")
    config = ReplayConfig(
        bytes_per_block=args.block_tokens * args.bytes_per_token,
        disk_budget_bytes=0.0,
        online=True,
        period_s=args.period,
        history_s=args.history,
        max_ttl_s=args.max_ttl,
        score_from_s=args.score_from,
    )
    if not args.capacity_factor >= 1:
        parser.error("--capacity-factor must be >= 1 (the capacity cannot be below the budget)")
    rows = sweep(trace.requests, budgets, config, policies, args.groups, args.capacity_factor)
    report = {
        "trace": str(args.trace),
        "requests": len(trace.requests),
        "score_from_s": args.score_from,
        "capacity_factor": args.capacity_factor,
        "bytes_per_block": config.bytes_per_block,
        "rows": rows,
    }
    text = json.dumps(report, indent=1) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    for row in rows:
        print(
            f"{row['budget_gb']:>8g} GB  "
            + "  ".join(
                f"{name} {row[name]['hit_ratio']['disk']:.4f}"
                f" (peak/budget {row[name]['peak_over_budget']:.2f})"
                for name in policies
            ),
            file=sys.stderr,
        )
    return 0


def _capacity_factor(config: ReplayConfig) -> float:
    """The shadow disks' capacity as a multiple of the budget: the replay's own (uncapped: inf)."""
    capacity, budget = config.disk_capacity_bytes, config.disk_budget_bytes
    if capacity is None or budget <= 0:
        return math.inf
    return max(1.0, capacity / budget)


def replay_with_progress(
    requests: Sequence[TraceRequest],
    planner: TtlPlanner,
    config: ReplayConfig,
    label: str,
    leave: bool = True,
) -> ReplayResult:
    """`replay` with a progress bar of its requests on stderr, shown only on a terminal."""
    with tqdm(total=len(requests), desc=label, unit="req", leave=leave, disable=None) as bar:
        return replay(requests, planner, config, progress=bar.update)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "synth":
        return synth_main(parser, args)
    if args.command == "sweep":
        return sweep_main(parser, args)
    for name in ("disk_budget_gb", "dram_gb"):
        value = getattr(args, name)
        if not math.isfinite(value) or value < 0:
            parser.error(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
    if args.block_tokens <= 0 or args.bytes_per_token <= 0 or args.groups < 0:
        parser.error("--block-tokens and --bytes-per-token must be > 0, --groups >= 0")
    if args.period <= 0 or args.history <= 0 or args.max_ttl <= 0:
        parser.error("--period, --history, --max-ttl must be > 0")
    if (args.initial_ttl is not None and args.initial_ttl < 0) or args.score_from < 0:
        parser.error("--initial-ttl and --score-from must be >= 0")
    try:
        trace = load_trace(args.trace)
    except OSError as error:
        parser.error(f"cannot read trace: {error}")
    bytes_per_block = args.block_tokens * args.bytes_per_token
    config = ReplayConfig(
        bytes_per_block=bytes_per_block,
        disk_budget_bytes=args.disk_budget_gb * GB,
        dram_bytes=args.dram_gb * GB,
        online=args.online,
        period_s=args.period,
        history_s=args.history,
        initial_ttl_s=args.initial_ttl,
        max_ttl_s=args.max_ttl,
        score_from_s=args.score_from,
        disk_capacity_bytes=None if args.capacity_gb is None else args.capacity_gb * GB,
    )
    planner: TtlPlanner
    if args.policy == "fixed":
        planner = FixedTtlPlanner(args.max_ttl)
    else:
        group = GroupTtlPlanner(
            args.groups, args.max_ttl, args.seed, validation_fraction=0.0, shrink_events=0.0
        )
        planner = (
            group
            if args.no_validation
            else ShadowGuardPlanner(
                [FixedTtlPlanner(args.max_ttl), group],
                capacity_factor=_capacity_factor(config),
            )
        )
    result = replay_with_progress(trace.requests, planner, config, f"replay ({planner.name})")
    report = {
        "trace": str(args.trace),
        "skipped_lines": trace.skipped_lines,
        "bytes_per_block": bytes_per_block,
        "disk_budget_bytes": config.disk_budget_bytes,
        "dram_bytes": config.dram_bytes,
        "online": args.online,
        "groups": args.groups if args.policy == "group" else None,
        **result.to_json(),
    }
    json.dump(report, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0
