"""Do the generated traces look like the real one? Reuse intervals and block popularity of the
conversation trace beside the four generated shapes (default knobs).

    python -m benchmarks.trace_shapes [--real PATH]

Writes benchmarks/results/trace_shapes.json (per trace: counts, reuse-interval quantiles, the
share of accesses that are reuses, the share of accesses to the top 1 % of blocks, and both
histograms) and benchmarks/results/trace_shapes.png (reuse-interval CDF, rank-frequency of block
accesses).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

from benchmarks.shared_data import CONVERSATION_TRACE
from sglang_hicache_ext.tuning.trace import TraceRequest, load_trace, parse_block_request
from sglang_hicache_ext.tuning.ttl.synth import SHAPES, generate

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
INTERVAL_BINS = np.logspace(-1, 4, 26)  # 0.1 s .. 10^4 s


def shape_of(requests: list[TraceRequest]) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """Summary, reuse intervals (s) and per-block access counts (descending) of one trace."""
    last: dict[str, float] = {}
    intervals: list[float] = []
    counts: Counter[str] = Counter()
    for request in requests:
        for page in request.pages:
            if page in last:
                intervals.append(request.time_s - last[page])
            last[page] = request.time_s
            counts[page] += 1
    gaps = np.asarray(intervals)
    popularity = np.sort(np.fromiter(counts.values(), dtype=float))[::-1]
    accesses = int(popularity.sum())
    top = max(1, len(popularity) // 100)
    histogram, _ = np.histogram(gaps, bins=INTERVAL_BINS)
    summary = {
        "requests": len(requests),
        "duration_s": requests[-1].time_s - requests[0].time_s,
        "blocks": len(popularity),
        "accesses": accesses,
        "blocks_per_request": accesses / len(requests),
        "reuse_share": len(gaps) / accesses,
        "reuse_interval_s": {
            q: float(np.quantile(gaps, p)) for q, p in (("p10", 0.1), ("p50", 0.5), ("p90", 0.9))
        },
        "top_1pct_blocks_share": float(popularity[:top].sum() / accesses),
        "interval_bins_s": INTERVAL_BINS.tolist(),
        "interval_histogram": (histogram / max(1, len(gaps))).tolist(),
    }
    return summary, gaps, popularity


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--real", type=Path, default=CONVERSATION_TRACE, help="the real trace (JSONL)"
    )
    args = parser.parse_args(argv)
    traces = {"conversation (real)": load_trace(args.real).requests}
    for name, shape in SHAPES.items():
        traces[name] = [parse_block_request(record) for record in generate(shape)]
    report: dict[str, Any] = {}
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, requests in traces.items():
        summary, gaps, popularity = shape_of(requests)
        report[name] = summary
        style = {"linewidth": 2.5, "color": "black"} if "real" in name else {}
        left.plot(np.sort(gaps), np.linspace(0, 1, len(gaps)), label=name, **style)
        ranks = np.arange(1, len(popularity) + 1) / len(popularity)
        right.plot(ranks, popularity / popularity.sum(), label=name, **style)
    left.set(xscale="log", xlabel="reuse interval of a block, s", ylabel="CDF of reuses")
    right.set(
        xscale="log",
        yscale="log",
        xlabel="block rank (fraction of blocks)",
        ylabel="share of accesses",
    )
    left.legend(fontsize=8)
    figure.tight_layout()
    RESULTS.mkdir(exist_ok=True)
    figure.savefig(RESULTS / "trace_shapes.png", dpi=110)
    (RESULTS / "trace_shapes.json").write_text(json.dumps(report, indent=1) + "\n")
    for name, summary in report.items():
        q = summary["reuse_interval_s"]
        print(
            f"{name:22s} {summary['requests']:6d} req {summary['blocks_per_request']:5.1f} blk/req"
            f"  reuse {summary['reuse_share']:.2f}  interval p10/p50/p90"
            f" {q['p10']:7.1f} {q['p50']:7.1f} {q['p90']:7.1f} s"
            f"  top-1% blocks {summary['top_1pct_blocks_share']:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
