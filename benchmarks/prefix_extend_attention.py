"""New tokens after a cached prefix, on the CPU: the prefix attended apart and merged, against
placeholder queries for the prefix in one causal call (`fusion/attention.py`,
`PADDED_PREFIX_SHARE` chooses between them).

One layer's attention at SmolLM2-135M's heads (9 query heads, 3 KV heads, head size 64), fp32,
2 threads, for each (prefix, new tokens) pair: both ways in shuffled order per repeat (a fixed
order favours whichever call follows a similar one), medians over repeats. The JSON lands in
benchmarks/results/prefix_extend_attention.json.

    python -m benchmarks.prefix_extend_attention [--repeats 15]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.smollm2_server import RESULTS, report_header, write_json
from sglang_hicache_ext.fusion import attention

HEADS, KV_HEADS, HEAD_SIZE = 9, 3, 64
# (cached prefix, new tokens): a system prompt's page before prompts of a few lengths, and
# prefixes as long as the new text or longer (a conversation's next turn).
SHAPES = (
    (16, 64),
    (16, 900),
    (64, 900),
    (128, 900),
    (200, 700),
    (256, 660),
    (512, 400),
    (1024, 256),
    (256, 64),
)


def one_layer(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, padded: bool
) -> Callable[[], torch.Tensor]:
    """One call of the prefix extend of queries `q` over `k`/`v`, forced apart or padded."""
    prefix = k.shape[2] - q.shape[2]
    share = float("inf") if padded else -1.0

    def run() -> torch.Tensor:
        chosen, attention.PADDED_PREFIX_SHARE = attention.PADDED_PREFIX_SHARE, share
        try:
            return attention._prefix_extend_attention(q, k, v, prefix, HEAD_SIZE**-0.5)
        finally:
            attention.PADDED_PREFIX_SHARE = chosen

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls", type=int, default=4, help="calls per timing")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "prefix_extend_attention.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    runs = {}
    for prefix, new in SHAPES:
        q = torch.randn(1, HEADS, new, HEAD_SIZE)
        k = torch.randn(1, KV_HEADS, prefix + new, HEAD_SIZE)
        v = torch.randn(1, KV_HEADS, prefix + new, HEAD_SIZE)
        for padded in (False, True):
            runs[prefix, new, padded] = one_layer(q, k, v, padded)
    for (prefix, new, _), run in runs.items():
        assert torch.allclose(runs[prefix, new, False](), runs[prefix, new, True](), atol=1e-4)
        run()  # warm: the first call at a shape allocates
    seconds: dict[tuple[int, int, bool], list[float]] = {key: [] for key in runs}
    for _ in range(args.repeats):
        keys = list(runs)
        random.shuffle(keys)
        for key in keys:
            start = time.perf_counter()
            for _ in range(args.calls):
                runs[key]()
            seconds[key].append((time.perf_counter() - start) / args.calls)
    rows = []
    for prefix, new in SHAPES:
        apart = statistics.median(seconds[prefix, new, False])
        padded = statistics.median(seconds[prefix, new, True])
        rows.append(
            {
                "prefix_tokens": prefix,
                "new_tokens": new,
                "apart_ms": round(apart * 1e3, 3),
                "padded_ms": round(padded * 1e3, 3),
                "padded_over_apart": round(padded / apart, 3),
                "chosen": "padded" if prefix <= attention.PADDED_PREFIX_SHARE * new else "apart",
            }
        )
        print(rows[-1])
    report = {
        **report_header("benchmarks.prefix_extend_attention"),
        "heads": [HEADS, KV_HEADS, HEAD_SIZE],
        "threads": args.threads,
        "padded_prefix_share": attention.PADDED_PREFIX_SHARE,
        "rows": rows,
    }
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
