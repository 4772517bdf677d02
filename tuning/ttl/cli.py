"""`python -m sglang_hicache_ext.tuning.ttl replay`: replay a trace under a disk budget and print JSON."""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Sequence

from tqdm import tqdm

from sglang_hicache_ext.tuning.trace import TraceRequest, load_trace
from sglang_hicache_ext.tuning.ttl.planner import FixedTtlPlanner, GroupTtlPlanner, TtlPlanner
from sglang_hicache_ext.tuning.ttl.replay import (
    DEFAULT_BYTES_PER_TOKEN,
    ReplayConfig,
    ReplayResult,
    replay,
)

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
    run.add_argument("--policy", choices=("group", "fixed"), default="group")
    run.add_argument("--groups", type=int, default=32, help="K: top subtrees given own TTL")
    run.add_argument("--online", action="store_true", help="re-plan every period from the past")
    run.add_argument("--period", type=float, default=120.0, help="online period, seconds")
    run.add_argument(
        "--history", type=float, default=2400.0, help="online: seconds of past used to plan"
    )
    run.add_argument(
        "--initial-ttl", type=float, default=300.0, help="online: TTL of the first period"
    )
    run.add_argument("--max-ttl", type=float, default=3600.0, help="upper bound on any TTL")
    run.add_argument(
        "--no-validation",
        action="store_true",
        help="group policy: always publish group TTLs (no held-out check against one TTL)",
    )
    run.add_argument("--seed", type=int, default=0, help="seed of the multi-start perturbations")
    return parser


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
    for name in ("disk_budget_gb", "dram_gb"):
        value = getattr(args, name)
        if not math.isfinite(value) or value < 0:
            parser.error(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
    if args.block_tokens <= 0 or args.bytes_per_token <= 0 or args.groups < 0:
        parser.error("--block-tokens and --bytes-per-token must be > 0, --groups >= 0")
    if args.period <= 0 or args.history <= 0 or args.max_ttl <= 0 or args.initial_ttl < 0:
        parser.error("--period, --history, --max-ttl must be > 0 and --initial-ttl >= 0")
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
    )
    planner: TtlPlanner
    if args.policy == "fixed":
        planner = FixedTtlPlanner(args.max_ttl)
    else:
        validation = 0.0 if args.no_validation else 1 / 3
        planner = GroupTtlPlanner(args.groups, args.max_ttl, args.seed, validation)
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
