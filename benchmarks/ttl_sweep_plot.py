"""Disk hit ratio vs disk budget per TTL policy, one panel per trace, from
benchmarks/results/ttl_sweep_<trace>.json (written by `python -m sglang_hicache_ext.tuning.ttl sweep`).

    python -m benchmarks.ttl_sweep_plot
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TRACES = ("conversation", "production-like", "chat", "bursty", "uniform", "agent")
POLICIES = ("fixed", "group", "group+fallback")


def main() -> int:
    figure, axes = plt.subplots(1, len(TRACES), figsize=(4 * len(TRACES), 3.6))
    for axis, name in zip(axes, TRACES, strict=True):
        report = json.loads((RESULTS / f"ttl_sweep_{name}.json").read_text())
        budgets = [row["budget_gb"] for row in report["rows"]]
        for policy in POLICIES:
            ratios = [row[policy]["hit_ratio"]["disk"] for row in report["rows"]]
            axis.plot(budgets, ratios, marker="o", label=policy)
        scored = " (second half)" if report.get("score_from_s") else ""
        axis.set_title(f"{name}{scored}, {report['requests']} requests", fontsize=9)
        axis.set_xscale("log")
        axis.set_xlabel("disk budget, GB (capacity 2x)")
    axes[0].set_ylabel("disk hit ratio")
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    out = RESULTS / "ttl_sweep.png"
    figure.savefig(out, dpi=110)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
