"""How much of the reusable chunk tokens does a host budget keep, by policy? (issue 56, first look)

An offline trace of requests, each holding `--per-request` document pieces: a share of them
(`--one-off`) seen once only, the rest drawn from `--popular` documents with Zipf popularity
(`--skew`); piece sizes 100-300 tokens. Host memory holds `--budget` times the popular set's
tokens. Per policy, over the requests after the first fifth (warm-up): tokens of pieces found in
memory / tokens of pieces seen before (what any policy could at best reuse).

- `lru`: every missed piece is stored, least recently used pieces evicted (today's host cache).
- `lru+frequency`: every sight is recorded in `tiers/chunks/admission.py`'s sketch; a missed
  piece is stored only when it was seen more often than every piece it would evict.
- `belady`: offline, the piece whose next use is furthest (never: first) is evicted, the
  missed piece itself included (so it may be passed over). With unequal sizes this rule is a
  reference, not a proven optimum.

    python -m research.chunk_admission_trace   # research/results/chunk_admission_trace.json
"""

from __future__ import annotations

import argparse
import json
import random
from collections import OrderedDict
from pathlib import Path

from benchmarks.chunk_admission_trace import reusable_tokens, run_belady
from sglang_hicache_ext.tiers.chunks.admission import FrequencyAdmission, FrequencySketch

Trace = list[list[str]]
RESULTS = Path(__file__).resolve().parent / "results"


def make_trace(
    requests: int, per_request: int, popular: int, skew: float, one_off: float, seed: int
) -> tuple[Trace, dict[str, int]]:
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** skew for rank in range(popular)]
    sizes = {f"doc{i}": rng.randint(100, 300) for i in range(popular)}
    trace: Trace = []
    for r in range(requests):
        pieces = []
        for p in range(per_request):
            if rng.random() < one_off:
                key = f"once{r}-{p}"
                sizes[key] = rng.randint(100, 300)
            else:
                key = rng.choices(range(popular), weights)[0]
                key = f"doc{key}"
            if key not in pieces:
                pieces.append(key)
        trace.append(pieces)
    return trace, sizes


def run_lru(
    trace: Trace, sizes: dict[str, int], budget: int, start: int, admission: bool = False
) -> int:
    held: OrderedDict[str, None] = OrderedDict()
    used = reused = 0
    gate = FrequencyAdmission(FrequencySketch.for_entries(4 * len(trace))) if admission else None
    for index, pieces in enumerate(trace):
        for key in pieces:
            if gate is not None:
                gate.record(key)
            if key in held:
                held.move_to_end(key)
                reused += sizes[key] if index >= start else 0
                continue
            size = sizes[key]
            if size > budget:
                continue
            victims, freed = [], budget - used
            for victim in held:
                if freed >= size:
                    break
                victims.append(victim)
                freed += sizes[victim]
            if gate is not None and not gate.admit(key, victims):
                continue
            for victim in victims:
                del held[victim]
                used -= sizes[victim]
            held[key] = None
            used += size
    return reused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--per-request", type=int, default=8)
    parser.add_argument("--popular", type=int, default=40)
    parser.add_argument("--skews", default="0.8,1.0,1.2")
    parser.add_argument("--one-offs", default="0.5,0.8,0.95")
    parser.add_argument("--budgets", default="0.5,1.0,1.5,2.0", help="x the popular set's tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "chunk_admission_trace.json")
    args = parser.parse_args()
    rows = []
    print(f"{'skew':>5}{'one-off':>8}{'budget':>7}{'lru':>8}{'lru+freq':>9}{'belady':>8}")
    for skew in map(float, args.skews.split(",")):
        for one_off in map(float, args.one_offs.split(",")):
            trace, sizes = make_trace(
                args.requests, args.per_request, args.popular, skew, one_off, args.seed
            )
            start = len(trace) // 5
            popular_tokens = sum(sizes[f"doc{i}"] for i in range(args.popular))
            reusable = reusable_tokens(trace, sizes, start)
            for factor in map(float, args.budgets.split(",")):
                budget = int(factor * popular_tokens)
                shares = {
                    "lru": run_lru(trace, sizes, budget, start) / reusable,
                    "lru+frequency": run_lru(trace, sizes, budget, start, True) / reusable,
                    "belady": run_belady(trace, sizes, budget, start) / reusable,
                }
                rows.append({"skew": skew, "one_off": one_off, "budget": factor, **shares})
                print(
                    f"{skew:>5}{one_off:>8}{factor:>7}{shares['lru']:>8.3f}"
                    f"{shares['lru+frequency']:>9.3f}{shares['belady']:>8.3f}",
                    flush=True,
                )
    report = {
        "command": "python -m research.chunk_admission_trace",
        "args": vars(args),
        "rows": rows,
    }
    report["args"] = {**vars(args), "out": str(args.out.relative_to(RESULTS.parent.parent))}
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
