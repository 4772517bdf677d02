"""Traces of document pieces for the host-memory benchmarks, and the offline optimum over them.

- synthetic: `per_request` pieces a request, a share (`one_off`) seen once only, the rest drawn
  from `popular` documents with Zipf popularity (`skew`); 100-300 tokens a piece;
- the Mooncake conversation trace (`../shared/data/traces/`) mapped to documents: each 512-token
  block of a request is a piece (its last one shorter), so a conversation's earlier turns and the
  shared system prompt are the documents seen again.

`reusable_tokens` is what any policy could at best reuse (tokens of pieces seen before);
`run_belady` what the offline rule keeps: the piece whose next use is furthest (never: first) is
evicted, the missed piece itself included. With unequal sizes it is the reference, not a proven
optimum (the exact problem is NP-hard).
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks.shared_data import CONVERSATION_TRACE
from benchmarks.smollm2_server import write_json

Trace = list[list[str]]
BLOCK_TOKENS = 512  # the Mooncake trace's block size


def synthetic_trace(
    requests: int, per_request: int, popular: int, skew: float, one_off: float, seed: int
) -> tuple[Trace, dict[str, int]]:
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** skew for rank in range(popular)]
    sizes = {f"doc{i}": rng.randint(100, 300) for i in range(popular)}
    trace: Trace = []
    for r in range(requests):
        pieces: list[str] = []
        for p in range(per_request):
            if rng.random() < one_off:
                key = f"once{r}-{p}"
                sizes[key] = rng.randint(100, 300)
            else:
                key = f"doc{rng.choices(range(popular), weights)[0]}"
            if key not in pieces:
                pieces.append(key)
        trace.append(pieces)
    return trace, sizes


def mooncake_trace(path: Path, limit: int | None) -> tuple[Trace, dict[str, int]]:
    trace: Trace = []
    sizes: dict[str, int] = {}
    with path.open() as lines:
        for number, line in enumerate(lines):
            if limit is not None and number >= limit:
                break
            record = json.loads(line)
            blocks = [str(block) for block in record["hash_ids"]]
            for index, block in enumerate(blocks):
                last = index == len(blocks) - 1
                tail = record["input_length"] - BLOCK_TOKENS * (len(blocks) - 1)
                sizes.setdefault(block, max(1, tail) if last else BLOCK_TOKENS)
            trace.append(list(dict.fromkeys(blocks)))
    return trace, sizes


def reused_set_tokens(trace: Trace, sizes: dict[str, int]) -> int:
    """Tokens of the pieces seen more than once: what the Mooncake budgets are measured in."""
    seen: dict[str, int] = {}
    for pieces in trace:
        for key in pieces:
            seen[key] = seen.get(key, 0) + 1
    return sum(sizes[key] for key, count in seen.items() if count > 1)


def _sights(trace: Trace, start: int) -> Iterator[tuple[bool, str]]:
    for index, pieces in enumerate(trace):
        for key in pieces:
            yield index >= start, key


def run_belady(trace: Trace, sizes: dict[str, int], budget: int, start: int) -> int:
    flat = list(_sights(trace, start))
    next_use: list[float] = [float("inf")] * len(flat)
    last: dict[str, int] = {}
    for position in range(len(flat) - 1, -1, -1):
        key = flat[position][1]
        next_use[position] = last.get(key, float("inf"))
        last[key] = position
    held: dict[str, float] = {}  # key -> its next use
    heap: list[tuple[float, str]] = []  # (-next use, key), stale entries skipped
    used = reused = 0
    for position, (counted, key) in enumerate(flat):
        upcoming = next_use[position]
        if key in held:
            reused += sizes[key] if counted else 0
        else:
            if upcoming == float("inf") or sizes[key] > budget:
                continue  # never used again: storing it cannot help
            used += sizes[key]
        held[key] = upcoming
        heapq.heappush(heap, (-upcoming, key))
        while used > budget:
            far, victim = heapq.heappop(heap)
            if held.get(victim) != -far:
                continue
            del held[victim]
            used -= sizes[victim]
    return reused


def reusable_tokens(trace: Trace, sizes: dict[str, int], start: int) -> int:
    seen: set[str] = set()
    total = 0
    for counted, key in _sights(trace, start):
        if key in seen and counted:
            total += sizes[key]
        seen.add(key)
    return total


def floats(text: str) -> list[float]:
    return [float(item) for item in text.split(",")]


def trace_arguments(description: str, budgets: str, trace_budgets: str) -> argparse.ArgumentParser:
    """The options every trace benchmark takes: the synthetic mixes, the budgets (times the
    popular set; the Mooncake ones times its reused set), the disk tier and the Mooncake trace."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--per-request", type=int, default=8)
    parser.add_argument("--popular", type=int, default=40)
    parser.add_argument("--skews", default="0.8,1.0,1.2")
    parser.add_argument("--one-offs", default="0.5,0.8,0.95")
    parser.add_argument("--budgets", default=budgets)
    parser.add_argument("--disk-budget", type=float, default=2.0, help="0: no disk rows")
    parser.add_argument("--trace", type=Path, default=None, help="the Mooncake trace's path")
    parser.add_argument("--trace-requests", type=int, default=None)
    parser.add_argument("--trace-budgets", default=trace_budgets)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from --out")
    return parser


class Mix(NamedTuple):
    skew: float
    one_off: float
    budget: float
    disk: float
    trace: Trace
    sizes: dict[str, int]
    popular_tokens: int

    def key(self) -> dict[str, float]:
        return {
            "skew": self.skew,
            "one_off": self.one_off,
            "budget": self.budget,
            "disk": self.disk,
        }


def synthetic_mixes(args: argparse.Namespace) -> Iterator[Mix]:
    """Every (skew, one-off share, budget, disk) of `trace_arguments`' options, one trace per
    (skew, one-off share)."""
    disks = [0.0, args.disk_budget] if args.disk_budget else [0.0]
    for skew in floats(args.skews):
        for one_off in floats(args.one_offs):
            trace, sizes = synthetic_trace(
                args.requests, args.per_request, args.popular, skew, one_off, args.seed
            )
            popular_tokens = sum(sizes[f"doc{i}"] for i in range(args.popular))
            for budget in floats(args.budgets):
                for disk in disks:
                    yield Mix(skew, one_off, budget, disk, trace, sizes, popular_tokens)


def mooncake_rows(
    args: argparse.Namespace,
    measure_mix: Callable[[Trace, dict[str, int], int, float, float], dict[str, Any]],
) -> dict[str, Any] | None:
    """The report's Mooncake section: a row per `--trace-budgets` budget without and with a disk
    tier 2x host, `measure_mix(trace, sizes, reused-set tokens, budget, disk)` each, with the
    trace's requests and reused-set tokens. None when the trace is not there."""
    path = args.trace or CONVERSATION_TRACE
    if not path.exists():
        return None
    trace, sizes = mooncake_trace(path, args.trace_requests)
    reused_set = reused_set_tokens(trace, sizes)
    rows = []
    for budget in floats(args.trace_budgets):
        for disk in (0.0, 2 * budget):
            row = measure_mix(trace, sizes, reused_set, budget, disk)
            rows.append({"budget": budget, "disk": disk} | row)
            print(json.dumps(rows[-1]), file=sys.stderr)
    return {
        "requests": len(trace),
        "reused_set_tokens": reused_set,
        "rows": rows,
        "by_budget": {mix_key(row): row for row in rows},
    }


def mix_key(row: dict[str, Any]) -> str:
    """A row's name in `by_mix` / `by_budget`: "skew/one-off/budget" (synthetic) or "budget",
    with "+disk" when a disk tier sits below."""
    name = "/".join(f"{row[k]:g}" for k in ("skew", "one_off", "budget") if k in row)
    return name + ("+disk" if row["disk"] else "")


def label_mixes(axis: Any, rows: list[dict[str, Any]], **labels: Any) -> None:
    """A per-mix axis's ticks (`mix_key`), labels and legend."""
    axis.set_xticks(range(len(rows)), [mix_key(row) for row in rows], rotation=90, fontsize=6)
    axis.set(**labels)
    axis.legend(fontsize=7)


def redo_saved_report(
    args: argparse.Namespace,
    plot: Callable[[dict[str, Any], Path], Path],
    summarise: Callable[[dict[str, Any]], None] | None = None,
) -> bool:
    """`--plot-only`: redraw `--out`'s figure; `--summary-only` (when `summarise` is given):
    redo its summary in place, write it and redraw. False when neither was asked."""
    if not (args.plot_only or (summarise is not None and args.summary_only)):
        return False
    report = json.loads(args.out.read_text())
    if not args.plot_only and summarise is not None:
        summarise(report)
        write_json(args.out, report)
    print(args.out, plot(report, args.out.with_suffix(".png")))
    return True


def write_trace_report(
    report: dict[str, Any],
    args: argparse.Namespace,
    measure_mix: Callable[[Trace, dict[str, int], int, float, float], dict[str, Any]],
    summarise: Callable[[dict[str, Any]], None],
    plot: Callable[[dict[str, Any], Path], Path],
) -> None:
    """A trace benchmark's run after its `report` head: `measure_mix(trace, sizes, reference
    tokens, budget, disk)` over every synthetic mix (`synthetic_mixes`; the reference is the
    popular set's tokens) and the Mooncake trace's budgets (`mooncake_rows`), the ranges
    (`summarise`), then `--out` and its figure written."""
    rows = []
    for mix in synthetic_mixes(args):
        row = measure_mix(mix.trace, mix.sizes, mix.popular_tokens, mix.budget, mix.disk)
        rows.append(mix.key() | row)
        print(json.dumps(rows[-1]), file=sys.stderr)
    report["synthetic"] = {
        "requests": args.requests,
        "popular": args.popular,
        "per_request": args.per_request,
        "mixes": len(rows),
        "rows": rows,
        "by_mix": {mix_key(row): row for row in rows},
    }
    if (moon := mooncake_rows(args, measure_mix)) is not None:
        report["mooncake"] = moon
    summarise(report)
    write_json(args.out, report)
    print(args.out, plot(report, args.out.with_suffix(".png")))
