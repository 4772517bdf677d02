"""Online group TTL vs online fixed TTL vs the best fixed TTL in hindsight, at equal disk bytes.

For each disk budget (average bytes on disk) on the Mooncake conversation trace:
1. online fixed TTL: every period, one TTL solved from earlier periods for the budget;
2. online group TTL (top-K subtrees + shared prefix + residual, Algorithm 2), its budget knob
   scaled (bracketing from 1 by factors of 1.1, then bisection) so that its *measured* average
   disk bytes come as close as possible to, but never above, those measured for (1);
3. the best fixed TTL in hindsight: one TTL for the whole hour, the largest whose measured
   average disk bytes do not exceed those of (2) (found by root finding on the TTL).
Writes benchmarks/results/ttl_replay.json and prints a table.

    python -m benchmarks.ttl_replay [--budgets-gb 300,800,2000] [--out FILE]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # SLSQP's small solves hate busy threads

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from scipy.optimize import brentq  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.shared_data import CONVERSATION_TRACE  # noqa: E402
from sglang_hicache_ext.tiers.pages.ttl_policy import TtlTable  # noqa: E402
from sglang_hicache_ext.tuning.trace import TraceRequest, load_trace  # noqa: E402
from sglang_hicache_ext.tuning.ttl.cli import replay_with_progress  # noqa: E402
from sglang_hicache_ext.tuning.ttl.planner import FixedTtlPlanner, GroupTtlPlanner, TtlPlanner  # noqa: E402
from sglang_hicache_ext.tuning.ttl.replay import (  # noqa: E402
    DEFAULT_BYTES_PER_TOKEN,
    ReplayConfig,
    ReplayResult,
)

RESULTS = Path(__file__).resolve().parent / "results"
GB = 1e9
MAX_TTL_S = 3600.0


def replay(requests: list[TraceRequest], planner: TtlPlanner, config: ReplayConfig) -> ReplayResult:
    """One full replay, with a transient progress bar under the budgets' bar."""
    label = f"{planner.name} @ {config.disk_budget_bytes / GB:.0f} GB"
    return replay_with_progress(requests, planner, config, label, leave=False)


def summary(result: ReplayResult) -> dict[str, Any]:
    data = result.to_json()
    choices = [p["choice"] for p in data.pop("ttls")]
    data["periods"] = len(choices)
    data["periods_with_group_ttls"] = choices.count("group")
    return data


def calibrate_group(
    requests: list[TraceRequest],
    config: ReplayConfig,
    planner: GroupTtlPlanner,
    max_bytes: float,
    steps: int,
) -> tuple[ReplayResult, float]:
    """Budget multiplier whose measured average bytes come closest to max_bytes from below.

    Starts at 1, walks by factors of 1.1 until max_bytes is bracketed, then bisects; the result
    is the feasible run (bytes <= max_bytes) with the most bytes among all runs tried.
    """
    budget = config.disk_budget_bytes
    tried: list[tuple[float, ReplayResult]] = []

    def run(multiplier: float) -> ReplayResult:
        scaled = ReplayConfig(**{**config.__dict__, "disk_budget_bytes": budget * multiplier})
        result = replay(requests, planner, scaled)
        tried.append((multiplier, result))
        return result

    low = high = None
    multiplier = 1.0
    for _ in range(steps):
        if low is not None and high is not None:
            multiplier = math.sqrt(low * high)
        result = run(multiplier)
        if result.avg_disk_bytes <= max_bytes:
            low = multiplier
            if result.avg_disk_bytes >= 0.998 * max_bytes:
                break
            if high is None:
                multiplier *= 1.1
        else:
            high = multiplier
            if low is None:
                multiplier /= 1.1
    feasible = [(m, r) for m, r in tried if r.avg_disk_bytes <= max_bytes]
    while not feasible:  # never bracketed from below: keep shrinking until it fits
        multiplier = min(m for m, _ in tried) / 1.1
        result = run(multiplier)
        if result.avg_disk_bytes <= max_bytes:
            feasible.append((multiplier, result))
    multiplier, result = max(feasible, key=lambda item: item[1].avg_disk_bytes)
    return result, multiplier


def best_fixed_in_hindsight(
    requests: list[TraceRequest], config: ReplayConfig, max_bytes: float
) -> tuple[ReplayResult, float]:
    """The single TTL (whole trace) with the most hits whose average bytes are <= max_bytes.

    Average bytes and hits both grow with the TTL, so this is the TTL where bytes hit the cap.
    """
    static = ReplayConfig(**{**config.__dict__, "online": False})

    def run(ttl: float) -> ReplayResult:
        return replay(requests, FixedTtlPlanner(MAX_TTL_S, TtlTable(default_ttl=ttl)), static)

    ttl = brentq(lambda t: run(t).avg_disk_bytes - max_bytes, 0.0, MAX_TTL_S, xtol=0.05)
    while (result := run(ttl)).avg_disk_bytes > max_bytes:
        ttl -= 0.05
    return result, ttl


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=CONVERSATION_TRACE)
    parser.add_argument("--budgets-gb", default="300,800,2000", help="small,medium,large")
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--period", type=float, default=120.0)
    parser.add_argument("--history", type=float, default=2400.0)
    parser.add_argument("--initial-ttl", type=float, default=300.0)
    parser.add_argument("--dram-gb", type=float, default=0.0)
    parser.add_argument("--calibration-steps", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS / "ttl_replay.json")
    args = parser.parse_args()

    trace = load_trace(args.trace)
    bytes_per_block = 512 * DEFAULT_BYTES_PER_TOKEN
    rows = []
    started = time.time()
    budgets = [float(x) for x in args.budgets_gb.split(",")]
    for budget_gb in tqdm(budgets, desc="budgets", unit="budget", disable=None):
        config = ReplayConfig(
            bytes_per_block=bytes_per_block,
            disk_budget_bytes=budget_gb * GB,
            dram_bytes=args.dram_gb * GB,
            online=True,
            period_s=args.period,
            history_s=args.history,
            initial_ttl_s=args.initial_ttl,
        )
        fixed = replay(trace.requests, FixedTtlPlanner(MAX_TTL_S), config)
        group_planner = GroupTtlPlanner(args.groups, MAX_TTL_S)
        group, multiplier = calibrate_group(
            trace.requests, config, group_planner, fixed.avg_disk_bytes, args.calibration_steps
        )
        hindsight, hindsight_ttl = best_fixed_in_hindsight(
            trace.requests, config, group.avg_disk_bytes
        )
        row = {
            "budget_gb": budget_gb,
            "online_fixed": summary(fixed),
            "online_group": {**summary(group), "budget_multiplier": multiplier},
            "hindsight_fixed": {**summary(hindsight), "ttl_s": hindsight_ttl},
            "group_minus_fixed": group.disk_hit_ratio - fixed.disk_hit_ratio,
            "group_over_hindsight": group.disk_hit_ratio / hindsight.disk_hit_ratio,
            "group_bytes_le_fixed_bytes": group.avg_disk_bytes <= fixed.avg_disk_bytes,
        }
        rows.append(row)
        tqdm.write(
            f"{budget_gb:7.0f} GB | fixed {fixed.disk_hit_ratio:.4f} @ "
            f"{fixed.avg_disk_bytes / GB:7.1f} GB | group {group.disk_hit_ratio:.4f} @ "
            f"{group.avg_disk_bytes / GB:7.1f} GB (x{multiplier:.3f}) | hindsight "
            f"{hindsight.disk_hit_ratio:.4f} @ {hindsight.avg_disk_bytes / GB:7.1f} GB "
            f"(TTL {hindsight_ttl:.0f} s) | group/hindsight {row['group_over_hindsight']:.4f}"
        )
    report = {
        "trace": str(args.trace),
        "requests": len(trace.requests),
        "block_accesses": trace.accesses,
        "bytes_per_block": bytes_per_block,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "host": platform.node(),
        "seconds": time.time() - started,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
