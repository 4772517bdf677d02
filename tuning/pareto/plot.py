"""PNG of a frontier: cost against mean TTFT, throughput as colour, disk type as marker."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and CI

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from sglang_hicache_ext.tuning.pareto.evaluator import Evaluation  # noqa: E402

_MARKERS = {"none": "o", "essd_pl0": "v", "essd_pl1": "s", "essd_pl2": "D", "essd_pl3": "^"}


def plot_frontier(
    evaluated: Sequence[Evaluation], frontier: Sequence[Evaluation], path: Path, title: str
) -> None:
    figure, axes = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    axes.scatter(
        [e.result.cost.total_usd for e in evaluated],
        [e.result.mean_ttft_s for e in evaluated],
        s=10,
        c="lightgrey",
        label="simulated",
    )
    colour_range = [e.result.throughput_tok_s for e in frontier]
    for disk in sorted({e.point.disk for e in frontier}):
        group = [e for e in frontier if e.point.disk == disk]
        mappable = axes.scatter(
            [e.result.cost.total_usd for e in group],
            [e.result.mean_ttft_s for e in group],
            c=[e.result.throughput_tok_s for e in group],
            vmin=min(colour_range),
            vmax=max(colour_range),
            cmap="viridis",
            marker=_MARKERS.get(disk, "x"),
            edgecolors="black",
            linewidths=0.4,
            label=f"frontier, disk {disk}",
        )
    if frontier:
        figure.colorbar(mappable, ax=axes, label="throughput (tok/s)")
    axes.set_xlabel("cost of serving the trace (USD, GPU-hours include draining)")
    axes.set_ylabel("mean TTFT (s)")
    axes.set_yscale("log")
    plain = FuncFormatter(lambda value, _: f"{value:g}")  # 4000, not 4 x 10^3
    axes.yaxis.set_major_formatter(plain)
    axes.yaxis.set_minor_formatter(plain)
    axes.set_title(title, fontsize=10)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
