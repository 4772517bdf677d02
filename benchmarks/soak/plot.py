"""The report's PNG: RSS of the server's process group and request latency over time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.soak.records import FAILURE_CLASSES


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rss, ax_lat) = plt.subplots(2, 1, figsize=(12.5, 7.5), sharex=True)
    samples = report["rss"]["samples"]
    if samples:
        ax_rss.plot(
            [t / 60 for t, _ in samples], [b / 2**30 for _, b in samples], color="tab:blue", lw=1.2
        )
    growth = report["rss"]["growth"]
    ax_rss.axvspan(
        growth["window_start_s"] / 60,
        report["duration_s"] / 60,
        color="tab:green",
        alpha=0.08,
        label=f"growth window (median growth {growth.get('growth_median', float('nan')):+.2%})",
    )
    ax_rss.set_ylabel("server RSS, process group (GiB)")
    ax_rss.grid(alpha=0.3)
    records = report["records"]
    kinds = sorted({r[1] for r in records})
    cmap = plt.get_cmap("tab10")
    for i, kind in enumerate(kinds):
        ok = [(r[0] / 60, r[4]) for r in records if r[1] == kind and r[3] not in FAILURE_CLASSES]
        if ok:
            ax_lat.scatter(
                *zip(*ok, strict=True),
                s=9,
                color=cmap(i % 10),
                marker="o^sD"[i // 10 % 4],
                label=kind,
                alpha=0.7,
            )
    bad = [(r[0] / 60, r[4]) for r in records if r[3] in FAILURE_CLASSES]
    if bad:
        ax_lat.scatter(*zip(*bad, strict=True), s=30, marker="x", color="red", label="failure")
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("request latency (s), at request start")
    ax_lat.set_xlabel("minutes since start of traffic")
    ax_lat.grid(alpha=0.3)
    fault = report.get("fault") or {}
    for ax in (ax_rss, ax_lat):
        if "t" in fault:
            ax.axvline(fault["t"] / 60, color="red", ls="--", lw=1, label="storage fault")
            if "held_s" in fault:
                ax.axvspan(
                    fault["t"] / 60,
                    (fault["t"] + fault["held_s"]) / 60,
                    color="red",
                    alpha=0.08,
                    label="traffic held (fault)",
                )
        if report.get("crash"):
            ax.axvline(report["crash"]["t"] / 60, color="black", lw=2, label="crash")
    ax_rss.legend(loc="lower right", fontsize=8)
    ax_lat.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, markerscale=1.5)
    acc = report["acceptance"]
    fig.suptitle(
        f"soak {report['duration_s'] / 60:g} min, {report['requests']['total']} requests, "
        f"crashes {report['crashes']}, {'PASS' if acc['pass'] else 'FAIL'}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
