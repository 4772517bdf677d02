"""How much of the reusable chunk tokens host memory keeps under pressure, by admission policy.

Traces of requests, each a list of document pieces (the pieces `auto_chunks` keeps):
- synthetic: `--per-request` pieces a request, a share (`--one-offs`) seen once only, the rest
  drawn from `--popular` documents with Zipf popularity (`--skews`); 100-300 tokens a piece;
- the Mooncake conversation trace (`../shared/data/traces/`) mapped to documents: each 512-token
  block of a request is a piece (its last one shorter), so a conversation's earlier turns and the
  shared system prompt are the documents seen again.

Per policy and host budget (`--budgets`, times the popular set's tokens; for the Mooncake trace
times the tokens of the blocks seen more than once), over the requests after the first fifth
(warm-up): tokens of pieces found stored / tokens of pieces seen before, which is what any policy
could at best reuse. The policies run the shipped code: `HostChunkCache` with and without its
`FrequencyAdmission` (sized by the settings' default), every sight recorded as the server's
`AutoCapture` records it, every missed piece offered as it offers one.

- `lru`: `chunk_admission: "lru"`, every missed piece stored, the least recently used evicted;
- `frequency`: `chunk_admission: "frequency"` (the default);
- `belady`: offline, with the future known: the piece whose next use is furthest (never: first)
  is evicted, the missed piece itself included. With unequal sizes it is the reference, not a
  proven optimum (the exact problem is NP-hard).

With `--disk-budget X` a disk tier below host memory of X times the same set: every piece host
memory takes is also written to disk (write-through), the disk evicts by recency, and a piece
found only on disk is reused (read back, promoted to host memory as the server promotes: without
admission). Belady then holds host + disk budget as one.

    python -m benchmarks.chunk_admission_trace   # benchmarks/results/chunk_admission_trace.json
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.shared_data import CONVERSATION_TRACE
from benchmarks.smollm2_server import write_json
from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings
from sglang_hicache_ext.tiers.chunks.admission import FrequencyAdmission
from sglang_hicache_ext.tiers.chunks.host_cache import HostCacheFullError, HostChunkCache

Trace = list[list[str]]
RESULTS = Path(__file__).resolve().parent / "results"
BLOCK_TOKENS = 512  # the Mooncake trace's block size
SKETCH_ENTRIES = ExtensionSettings.model_fields["chunk_admission_sketch_entries"].default


@dataclass(frozen=True)
class Piece:
    nbytes: int  # tokens here: the budgets are in tokens


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


def _sights(trace: Trace, start: int) -> Iterator[tuple[bool, str]]:
    for index, pieces in enumerate(trace):
        for key in pieces:
            yield index >= start, key


def run_policy(
    trace: Trace,
    sizes: dict[str, int],
    host_budget: int,
    disk_budget: int,
    start: int,
    by_frequency: bool,
) -> int:
    """Reused tokens after `start` with the shipped host cache (and a disk tier's budget)."""
    admission = FrequencyAdmission.for_entries(SKETCH_ENTRIES) if by_frequency else None
    host: HostChunkCache[Piece] = HostChunkCache(host_budget, admission)
    disk: HostChunkCache[Piece] | None = HostChunkCache(disk_budget) if disk_budget else None
    reused = 0
    for index, pieces in enumerate(trace):
        if admission is not None:
            for key in pieces:  # AutoCapture records a prompt's sights before judging any
                admission.record(key)
        for key in pieces:
            piece = Piece(sizes[key])
            if host.get(key) is not None:
                reused += piece.nbytes if index >= start else 0
                continue
            if disk is not None and disk.get(key) is not None:
                reused += piece.nbytes if index >= start else 0
                # Promoted as ChunkTiers.pin promotes: no admission for a chunk being read.
                with contextlib.suppress(HostCacheFullError):
                    host.put(key, piece)
                continue
            try:
                host.put(key, piece, by_frequency=True)
            except HostCacheFullError:  # NotAdmittedError, or larger than host memory
                continue
            if disk is not None:  # write-through of what host memory took
                with contextlib.suppress(HostCacheFullError):
                    disk.put(key, piece)
    return reused


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


def measure(
    trace: Trace, sizes: dict[str, int], reference_tokens: int, budget: float, disk: float
) -> dict[str, float]:
    start = len(trace) // 5
    host_budget = int(budget * reference_tokens)
    disk_budget = int(disk * reference_tokens)
    reusable = reusable_tokens(trace, sizes, start)
    row = {
        "lru": run_policy(trace, sizes, host_budget, disk_budget, start, by_frequency=False),
        "frequency": run_policy(trace, sizes, host_budget, disk_budget, start, by_frequency=True),
        "belady": run_belady(trace, sizes, host_budget + disk_budget, start),
    }
    shares = {name: value / reusable for name, value in row.items()}
    shares["frequency_of_belady"] = row["frequency"] / row["belady"]
    shares["lru_of_belady"] = row["lru"] / row["belady"]
    return shares


def _floats(text: str) -> list[float]:
    return [float(item) for item in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--per-request", type=int, default=8)
    parser.add_argument("--popular", type=int, default=40)
    parser.add_argument("--skews", default="0.8,1.0,1.2")
    parser.add_argument("--one-offs", default="0.5,0.8,0.95")
    parser.add_argument("--budgets", default="1.0,1.5,2.0")
    parser.add_argument("--disk-budget", type=float, default=2.0, help="0: no disk rows")
    parser.add_argument("--trace", type=Path, default=None, help="the Mooncake trace's path")
    parser.add_argument("--trace-requests", type=int, default=None)
    parser.add_argument("--trace-budgets", default="0.1,0.25,0.5,1.0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "chunk_admission_trace.json")
    args = parser.parse_args()

    rows: list[dict[str, Any]] = []
    disks = [0.0, args.disk_budget] if args.disk_budget else [0.0]
    for skew in _floats(args.skews):
        for one_off in _floats(args.one_offs):
            trace, sizes = synthetic_trace(
                args.requests, args.per_request, args.popular, skew, one_off, args.seed
            )
            popular_tokens = sum(sizes[f"doc{i}"] for i in range(args.popular))
            for budget in _floats(args.budgets):
                for disk in disks:
                    shares = measure(trace, sizes, popular_tokens, budget, disk)
                    rows.append(
                        {"skew": skew, "one_off": one_off, "budget": budget, "disk": disk}
                        | {name: round(value, 4) for name, value in shares.items()}
                    )
                    print(json.dumps(rows[-1]))
    path = args.trace or CONVERSATION_TRACE
    trace, sizes = mooncake_trace(path, args.trace_requests)
    seen: dict[str, int] = {}
    for pieces in trace:
        for key in pieces:
            seen[key] = seen.get(key, 0) + 1
    reused_set = sum(sizes[key] for key, count in seen.items() if count > 1)
    mooncake_rows: list[dict[str, Any]] = []
    for budget in _floats(args.trace_budgets):
        for disk in disks:
            shares = measure(trace, sizes, reused_set, budget, disk * budget)
            mooncake_rows.append(
                {"budget": budget, "disk": disk * budget}
                | {name: round(value, 4) for name, value in shares.items()}
            )
            print(json.dumps(mooncake_rows[-1]))
    report = {
        "command": "python -m benchmarks.chunk_admission_trace " + " ".join(sys.argv[1:]),
        "sketch_entries": SKETCH_ENTRIES,
        "metric": "reused tokens / tokens of pieces seen before, after the first fifth",
        "synthetic": {"popular": args.popular, "per_request": args.per_request, "rows": rows},
        "mooncake": {
            "requests": len(trace),
            "distinct_blocks": len(seen),
            "reused_set_tokens": reused_set,
            "rows": mooncake_rows,
        },
        "min_frequency_of_belady": min(row["frequency_of_belady"] for row in rows + mooncake_rows),
    }
    write_json(args.out, report)
    print(json.dumps({"min_frequency_of_belady": report["min_frequency_of_belady"]}))


if __name__ == "__main__":
    main()
