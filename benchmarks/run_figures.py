"""Pieces of the figures a benchmark draws of its own run (`benchmarks/plots.py` redraws the
committed results): the TTFT-ratio distribution several live benchmarks show, and the title
and file every run's figure gets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402


def ttft_ratio_cdf(axes: Axes, ratios: list[float], label: str | None = None) -> None:
    """The share of requests (y) whose fused / fusion-off TTFT is at most x, on `axes`; x cut at
    2 (a request slowed by something else lies past the edge)."""
    ordered = sorted(ratios)
    axes.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)
    axes.set_xlim(0, 2)
    axes.set(xlabel="fused TTFT / fusion-off TTFT", ylabel="share of requests")


def save_run_figure(figure: Figure, report: dict[str, Any], out: Path, what: str = "") -> Path:
    """`figure` titled with the run's model and command (`what` before them), written to `out`
    and closed; returns `out`."""
    figure.suptitle(f"{what}{report['model']}, CPU: {report['command']}", fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)
    return out
