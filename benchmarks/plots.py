"""PNG figures of the committed benchmark results (reads JSON only: no server, no model, no trace).

- `fusion_quality_vs_ttft.png` (docs/fusion-sglang.md), from fusion_quality.json: answer quality
  kept against the TTFT paid, per selector and recompute ratio, both axes from that one run;
- `fusion_retention_vs_ttft.png` (docs/fusion-quality.md), from fusion_retention_<model>.json:
  F1 retention (95 % bootstrap interval) against the prefill-time ratio, a line per selector
  over its recompute ratios, a panel per model;
- `ttl_hit_ratio_vs_budget.png` (docs/ttl.md), from ttl_replay.json and ttl_budget_sweep.json
  (the same benchmark at more budgets): disk hit ratio against disk bytes per TTL policy;
- `fidelity_qwen.png`, `fidelity_dev_qwen.png` (docs/fusion-quality.md), from
  fusion_retention_qwen_bfloat16.json and fidelity_dev_qwen.json: KL gap closed, answers kept
  and agreement per method, with the full prefill's own noise floor;
- `placement.png` (docs/compression-placement.md), from placement.json: mean TTFT and mean
  answer quality per policy (LRU with and without a fixed codec, EvicPress placement);
- `pareto_<N>/frontier.png` (docs/simulator.md), from each `pareto_<N>/frontier.json`: drawn
  again by the Pareto search's own plot.

    python -m benchmarks.plots [--results benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")  # files only

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

from benchmarks.retention_summary import plot_methods  # noqa: E402
from sglang_hicache_ext.tuning.pareto.frontier_file import JSON_NAME, replot_frontier  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DPI = 110
GB = 1e9

# Selectors of fusion_quality.json drawn as a line over their recompute ratios.
SELECTORS = ("a3", "cacheblend", "epic", "freq", "random")
COLOURS = {
    "a3": "tab:blue",
    "cacheblend": "tab:orange",
    "epic": "tab:green",
    "freq": "tab:purple",
    "random": "tab:grey",
}
# TTL policies of ttl_replay.json rows: key, label, colour, marker.
TTL_POLICIES = (
    ("online_fixed", "online fixed TTL", "tab:blue", "o"),
    ("online_group", "online group TTLs", "tab:orange", "s"),
    ("hindsight_fixed", "best fixed TTL in hindsight", "tab:green", "^"),
)


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _quality_axes(
    axes: Axes, summary: dict[str, dict[str, float]], quality: str, scale: float
) -> None:
    """One panel: `summary[mode][quality] / scale` against the median TTFT ratio."""

    def point(mode: str) -> tuple[float, float]:
        return summary[mode]["ttft_ratio_median"], summary[mode][quality] / scale

    for selector in SELECTORS:
        modes = sorted(
            (m for m in summary if m.startswith(f"{selector}@")),
            key=lambda m: float(m.split("@")[1]),
        )
        xs, ys = zip(*(point(m) for m in modes), strict=True)
        axes.plot(xs, ys, "-o", color=COLOURS[selector], label=selector, markersize=5)
    for mode, marker in zip((m for m in summary if "+sink" in m), "DP", strict=False):
        sinks, ratio = mode.split("+sink")[1].split("@")
        axes.plot(
            *point(mode),
            marker,
            color=COLOURS["a3"],
            markeredgecolor="black",
            markersize=7,
            linestyle="none",
            label=f"a3, {sinks} sink tokens, r={ratio}",
        )
    axes.plot(*point("reuse"), "kX", markersize=8, label="reuse (r=0)")
    axes.plot(*point("normal"), "k*", markersize=11, label="full prefill")
    axes.set_xlabel("TTFT, fused ÷ full prefill (median over questions)")
    axes.grid(alpha=0.3)


def plot_fusion_quality(results: Path, out: Path) -> Path:
    data = _load(results / "fusion_quality.json")
    summary = data["summary"]
    figure, (similarity, f1) = plt.subplots(1, 2, figsize=(11, 4.4), dpi=DPI)
    _quality_axes(similarity, summary, "embedding_similarity", 1.0)
    similarity.set_ylabel("answer similarity to the full prefill's (MiniLM)")
    similarity.set_title(
        "similarity of the 16-token answer; lines: r = 0.05, 0.15, 0.3 left to right", fontsize=9
    )
    similarity.legend(fontsize=7, loc="lower right")
    normal_f1 = summary["normal"]["f1_gold"]
    _quality_axes(f1, summary, "f1_gold", normal_f1)
    f1.axhline(1.0, color="black", linewidth=0.6, linestyle=":")
    f1.set_ylabel("F1 vs gold ÷ full prefill's F1")
    f1.set_title(
        f"F1 vs gold, relative (the full prefill's F1 is only {normal_f1:.3f})", fontsize=9
    )
    title = (
        f"Chunk fusion through the CPU server: {data['questions']} HotpotQA questions, "
        f"{data['documents_per_prompt']} shuffled documents, {data['model']} "
        "(benchmarks/results/fusion_quality.json)"
    )
    return save_figure(figure, title, out)


def plot_fusion_retention(results: Path, out: Path) -> Path | None:
    # held-out dev runs (`--seed`) chose the selector; the figure shows the evaluation runs
    files = [p for p in sorted(results.glob("fusion_retention_*.json")) if "_seed" not in p.stem]
    if not files:
        return None
    figure, panels = plt.subplots(1, len(files), figsize=(5.6 * len(files), 4.4), dpi=DPI)
    for axes, path in zip(np.atleast_1d(panels), files, strict=True):
        data = _load(path)
        summary = data["summary"]
        lines: dict[str, list[str]] = {}
        for method in summary:
            if "@" in method:
                lines.setdefault(method.split("@")[0], []).append(method)
        for index, (selector, methods) in enumerate(sorted(lines.items())):
            methods.sort(
                key=lambda m: float(re.split("[#:]", m.split("@")[1])[0])
            )  # "0.15#int8", "0.15:keep0.25"
            xs = [summary[m]["prefill_ratio"] for m in methods]
            ys = [summary[m]["retention"] for m in methods]
            low = [y - summary[m]["retention_ci95"][0] for m, y in zip(methods, ys, strict=True)]
            high = [summary[m]["retention_ci95"][1] - y for m, y in zip(methods, ys, strict=True)]
            axes.errorbar(
                xs,
                ys,
                yerr=[low, high],
                fmt="-o",
                markersize=4,
                capsize=3,
                color=f"C{index}",
                label=selector,
            )
        reuse = summary["reuse"]
        axes.plot(
            reuse["prefill_ratio"], reuse["retention"], "kX", markersize=8, label="reuse (r=0)"
        )
        axes.plot(
            1.0, 1.0, "k*", markersize=11, label=f"full prefill (F1 {summary['full']['f1']:.3f})"
        )
        axes.axhline(0.95, color="black", linewidth=0.6, linestyle=":")
        axes.set_xlabel("prefill time, fused ÷ full (median over questions, in process)")
        axes.set_ylabel("F1 ÷ full prefill's F1 (95 % bootstrap interval)")
        axes.set_title(
            f"{data['model']} ({data.get('dtype', 'float32')}), "
            f"{summary['full']['questions']} HotpotQA questions",
            fontsize=9,
        )
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7, loc="lower right")
    title = "Answer F1 kept against prefill time paid (benchmarks/fusion_retention.py)"
    return save_figure(figure, title, out)


def plot_fidelity(results_file: Path, out: Path) -> Path | None:
    """Every method of a fusion_retention file (full prefill aside), with the noise floor."""
    if not results_file.exists():
        return None
    data = _load(results_file)
    return plot_methods(data, [m for m in data["summary"] if m != "full"], out)


def _ttl_rows(replayed: dict[str, Any], results: Path) -> list[dict[str, Any]]:
    """Rows of ttl_replay.json and, for budgets it lacks, of ttl_budget_sweep.json."""
    rows = {row["budget_gb"]: row for row in replayed["rows"]}
    sweep = results / "ttl_budget_sweep.json"
    if sweep.exists():
        for row in _load(sweep)["rows"]:
            rows.setdefault(row["budget_gb"], row)
    return [rows[budget] for budget in sorted(rows)]


def _finish_log_x_axes(axes: Axes, xlabel: str, ylabel: str, title: str) -> None:
    """Labels, legend and grid; log x ticked at 1, 2 and 5 times powers of ten, written 200
    rather than 2 x 10^2."""
    axes.set_xscale("log")
    axes.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axes.xaxis.set_minor_formatter(NullFormatter())
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title, fontsize=10)
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3, which="both")


def _disk_hits(row: dict[str, Any], policy: str) -> float:
    return row[policy]["hit_ratio"]["disk"]


def plot_ttl_budgets(results: Path, out: Path) -> Path:
    replayed = _load(results / "ttl_replay.json")
    rows = _ttl_rows(replayed, results)
    figure, (hits, gain) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=DPI)
    for key, label, colour, marker in TTL_POLICIES:
        hits.plot(
            [row[key]["avg_disk_bytes"] / GB for row in rows],
            [_disk_hits(row, key) for row in rows],
            marker=marker,
            color=colour,
            label=label,
            markersize=5,
        )
    _finish_log_x_axes(
        hits,
        "average bytes on disk over the hour (GB, measured; log scale)",
        f"disk hit ratio (of {replayed['block_accesses']:,} block accesses)",
        "hit ratio per policy at (nearly) equal disk bytes",
    )
    budgets = [row["budget_gb"] for row in rows]
    for other, label, colour in (
        ("online_fixed", "over online fixed TTL", "tab:blue"),
        ("hindsight_fixed", "over best fixed TTL in hindsight", "tab:green"),
    ):
        gain.plot(
            budgets,
            [100 * (_disk_hits(row, "online_group") / _disk_hits(row, other) - 1) for row in rows],
            "-o",
            color=colour,
            label=label,
            markersize=5,
        )
    gain.axhline(0.0, color="black", linewidth=0.6)
    _finish_log_x_axes(
        gain,
        "nominal disk budget (GB; log scale)",
        "more disk hits with group TTLs (%)",
        "gain of online group TTLs",
    )
    title = (
        f"TTL replay of {Path(replayed['trace']).name} ({replayed['requests']:,} requests, "
        f"{replayed['bytes_per_block'] / 2**20:.0f} MiB blocks): "
        "benchmarks/results/ttl_replay.json + ttl_budget_sweep.json"
    )
    return save_figure(figure, title, out)


TIER_STYLES = {
    "dram": "tab:blue",
    "disk": "tab:green",
    "disk_throttled": "tab:red",
    "mooncake": "tab:purple",
}


def plot_fusion_tiers(results_file: Path, out: Path) -> Path:
    """TTFT against the recompute ratio per chunk tier, the full prefill and the tuned ratio."""
    report = _load(results_file)
    figure, axes = plt.subplots(figsize=(7.5, 4.5), dpi=DPI)
    for tier, row in report["tiers"].items():
        colour = TIER_STYLES.get(tier, "tab:grey")
        curve = sorted((float(r), v["ttft_s"]) for r, v in row["ttft_by_ratio"].items())
        axes.plot(*zip(*curve, strict=True), "-o", color=colour, markersize=3, label=tier)
        axes.axhline(row["full_prefill_ttft_s"], color=colour, linestyle=":", linewidth=1)
        tuned = row["tuned"]
        axes.plot(tuned["ratio"], tuned["ttft_s"], "*", color=colour, markersize=13)
    axes.plot([], [], "k:", label="full prefill (same server)")
    axes.plot([], [], "k*", linestyle="none", label="tuned ratio")
    axes.set_xlabel("recompute ratio")
    axes.set_ylabel("median TTFT (s)")
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    title = (
        f"fused TTFT per chunk tier, {report['model']}, {report['prompts']} prompts "
        "(benchmarks/results/fusion_tiers.json)"
    )
    return save_figure(figure, title, out)


def plot_placement(results_file: Path, out: Path) -> Path | None:
    """Mean TTFT (bars) and mean quality (labels) per placement policy, with host hit shares."""
    if not results_file.exists():
        return None
    report = _load(results_file)
    policies = report["policies"]
    figure, axes = plt.subplots(figsize=(7.0, 4.0), dpi=DPI)
    names = list(policies)
    ttfts = [policies[name]["mean_ttft_s"] for name in names]
    colors = ["tab:grey", "tab:blue", "tab:cyan", "tab:orange", "tab:red"]
    bars = axes.bar(names, ttfts, color=colors[: len(names)])
    for bar, name in zip(bars, names, strict=True):
        row = policies[name]
        hits = row["chunk_hits_by_tier"]
        host = hits.get("host", 0) / max(1, sum(hits.values()))
        label = f"quality {100 * row['mean_quality']:.1f}\nhost hits {100 * host:.0f} %"
        axes.annotate(
            label,
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    axes.set_ylabel("mean TTFT (s)")
    axes.set_ylim(0, max(ttfts) * 1.3)
    axes.grid(axis="y", alpha=0.3)
    title = (
        f"{report['contexts']} HotpotQA contexts, Zipf {report['skew']}, host memory "
        f"{100 * report['dram_fraction']:.0f} % of dense, {report['model']}\n"
        f"(benchmarks/results/{results_file.name})"
    )
    return save_figure(figure, title, out)


def plot_decode_eviction(results_file: Path, out: Path) -> Path | None:
    """Median decode step per batch size, all prompt rows vs the kept capacity."""
    if not results_file.exists():
        return None
    report = _load(results_file)
    figure, axes = plt.subplots(figsize=(6.0, 3.8), dpi=DPI)
    batches = list(report["batches"])
    modes = list(report["batches"][batches[0]]["median_step_s"])
    width = 0.38
    for offset, (mode, color) in enumerate(zip(modes, ["tab:grey", "tab:orange"], strict=False)):
        steps = [1000 * report["batches"][b]["median_step_s"][mode] for b in batches]
        xs = [i + (offset - 0.5) * width for i in range(len(batches))]
        axes.bar(xs, steps, width, label=mode, color=color)
    for i, batch in enumerate(batches):
        ratio = report["batches"][batch]["step_ratio"]
        top = max(report["batches"][batch]["median_step_s"].values()) * 1000
        axes.annotate(f"{ratio:.2f}x", (i, top), ha="center", va="bottom", fontsize=9)
    axes.set_xticks(range(len(batches)), [f"{b} request(s)" for b in batches])
    axes.set_ylabel("median decode step (ms)")
    axes.legend()
    axes.grid(axis="y", alpha=0.3)
    title = (
        f"decode after a fused prefill, {report['model']}, CPU\n"
        f"(benchmarks/results/{results_file.name})"
    )
    return save_figure(figure, title, out)


def save_figure(figure: Figure, title: str, out: Path) -> Path:
    """Titled, laid out, written to `out` and closed (the other benchmarks plot through it)."""
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(out)
    plt.close(figure)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    results: Path = args.results
    written = [
        plot_fusion_quality(results, results / "fusion_quality_vs_ttft.png"),
        plot_ttl_budgets(results, results / "ttl_hit_ratio_vs_budget.png"),
        plot_fusion_retention(results, results / "fusion_retention_vs_ttft.png"),
        plot_fidelity(
            results / "fusion_retention_qwen_bfloat16.json", results / "fidelity_qwen.png"
        ),
        plot_fidelity(results / "fidelity_dev_qwen.json", results / "fidelity_dev_qwen.png"),
        plot_placement(results / "placement.json", results / "placement.png"),
        plot_placement(results / "placement_dram12.json", results / "placement_dram12.png"),
        plot_placement(
            results / "placement_live_dram12.json", results / "placement_live_dram12.png"
        ),
        plot_placement(
            results / "placement_live_int8_dram12.json", results / "placement_live_int8_dram12.png"
        ),
        plot_decode_eviction(results / "decode_eviction.json", results / "decode_eviction.png"),
        *(
            replot_frontier(json_file.parent)
            for json_file in sorted(results.glob(f"*/{JSON_NAME}"))
        ),
    ]
    for path in written:
        if path is not None:
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
