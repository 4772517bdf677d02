"""Past this machine: the TTFT that host memory's retention would give on an H200, projected from
the traces of `chunk_retention_trace` and the fused and full prefill times `fusion_gpu` measured
there (`tuning/sim/fused_serving.py` says how).

For every mix (synthetic: skew x one-off share x host budget, with and without a disk tier 2x
host; the Mooncake trace's blocks as documents) the replay of each arm (`lru`, `utility`)
records what each request after the warm-up read and from where; each request is then timed as
the normal prefill (`full`, no reuse) and fused under each arm: alone (service seconds) and in
one FIFO queue with Poisson arrivals at `--load` of the normal prefill's capacity. The
reference is EvicPress's: TTFT 1.22-1.56x lower than LRU eviction within 3 % quality, 1.29-2.19x
lower than the full prefill (Llama-3.1-8B and four other models, vLLM, LongBench contexts).

    python -m benchmarks.chunk_retention_projection
-> benchmarks/results/chunk_retention_projection.json and .png
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.chunk_admission_trace import RESULTS
from benchmarks.chunk_retention_trace import ARMS, run_arm
from benchmarks.piece_traces import (
    Trace,
    label_mixes,
    mix_key,
    redo_saved_report,
    trace_arguments,
    write_trace_report,
)
from benchmarks.smollm2_server import report_header
from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings
from sglang_hicache_ext.tuning.sim.fused_serving import FusedPrefillTimes, Load, fifo_ttfts

GPU_REPORT = RESULTS / "fusion_gpu_h200.json"
# Each prompt's tokens past its documents (system prompt, question), never reused.
QUESTION_TOKENS = 32
BREAK_EVEN = ExtensionSettings().fusion_min_matched_share
RULES = ("break_even", "always")
KINDS = ("service", "queued")


def project(
    trace: Trace,
    sizes: dict[str, int],
    reference_tokens: int,
    budget: float,
    disk: float,
    times: FusedPrefillTimes,
    kv_bytes: int,
    load: float,
) -> dict[str, Any]:
    """One mix: mean TTFT per arm alone and queued, with the server's break-even fallback
    (`break_even`) and with every prompt that reuses anything fused (`always`)."""
    start = len(trace) // 5
    host_budget, disk_budget = int(budget * reference_tokens), int(disk * reference_tokens)
    prompts = [sum(sizes[key] for key in pieces) + QUESTION_TOKENS for pieces in trace[start:]]
    reads: dict[str, list[list[Load]]] = {"full": [[] for _ in prompts]}
    for arm in ARMS:
        reads[arm] = []
        run_arm(trace, sizes, host_budget, disk_budget, start, arm, kv_bytes, reads[arm])
    row: dict[str, Any] = {"prompt_tokens_median": statistics.median(prompts)}
    rules = {"break_even": times, "always": dataclasses.replace(times, min_share=0.0)}
    for rule, timed in rules.items():
        service = {
            arm: [timed.ttft(t, r) for t, r in zip(prompts, read, strict=True)]
            for arm, read in reads.items()
        }
        rate = load / statistics.fmean(service["full"])
        figures: dict[str, float | None] = {}
        for arm, seconds in service.items():
            figures[f"{arm}_service_s"] = round(statistics.fmean(seconds), 4)
            figures[f"{arm}_queued_s"] = round(statistics.fmean(fifo_ttfts(seconds, rate)), 4)
        row[rule] = ratios(figures, load)
        row[rule] = figures
    return row


def ratios(figures: dict[str, float | None], load: float) -> dict[str, float | None]:
    """Each arm's utilisation of the queue (arrivals at `load` of the full prefill's capacity)
    and the TTFT ratios over utility's. An arm at or past a utilisation of 1 has no steady
    queue (its mean wait grows with the trace's length): its queued TTFT and ratios are None."""
    full = figures["full_service_s"]
    assert full is not None
    for arm in ("full", *ARMS):
        service = figures[f"{arm}_service_s"]
        assert service is not None
        figures[f"{arm}_utilisation"] = round(load * service / full, 4)
        if load * service / full >= 1:
            figures[f"{arm}_queued_s"] = None
    for kind in KINDS:
        utility = figures[f"utility_{kind}_s"]
        for base in ("lru", "full"):
            value = figures[f"{base}_{kind}_s"]
            ratio = None if value is None or utility is None else round(value / utility, 4)
            figures[f"{base}_over_utility_{kind}"] = ratio
    return figures


def summarise(report: dict[str, Any]) -> None:
    """Ranges over the rows the docs quote, per trace, without and with a disk tier, and per
    rule: TTFT of LRU and of the full prefill over retention by utility's, alone and queued
    (`unbounded`: the rows where an arm had no steady queue)."""
    for name in ("synthetic", "mooncake"):
        rows = report.get(name, {}).get("rows", [])
        ranges: dict[str, dict[str, dict[str, float | None]]] = {}
        for tier, with_disk in (("host", False), ("disk", True)):
            found_rows = [row for row in rows if bool(row["disk"]) == with_disk]
            if not found_rows:
                continue
            ranges[tier] = {}
            for rule in RULES:
                for kind in KINDS:
                    for base in ("lru", "full"):
                        key = f"{base}_over_utility_{kind}"
                        found = [row[rule][key] for row in found_rows]
                        values = [value for value in found if value is not None]
                        ranges[tier][f"{rule}_{key}"] = {
                            "min": min(values) if values else None,
                            "max": max(values) if values else None,
                            "unbounded": len(found) - len(values),
                        }
        if ranges:
            report[name]["ranges"] = ranges


def plot(report: dict[str, Any], out: Path) -> Path:
    """Mean queued TTFT per mix: the full prefill, fused under LRU and under utility (every
    prompt that reuses fused, and with the break-even fallback)."""
    import matplotlib.pyplot as plt

    sets = [name for name in ("synthetic", "mooncake") if name in report]
    figure, axes = plt.subplots(1, len(sets), figsize=(5.5 * len(sets), 4), squeeze=False)
    for axis, name in zip(axes[0], sets, strict=True):
        rows = sorted(  # unbounded (None) last
            report[name]["rows"],
            key=lambda row: row["always"]["lru_over_utility_queued"] or float("inf"),
        )
        axis.plot([row["always"]["full_queued_s"] for row in rows], "s-", color="C0", label="full")
        # An arm past a utilisation of 1 has no steady queue: a gap in its line.
        for colour, arm in enumerate(ARMS, start=1):
            for rule, style in (("always", "o-"), ("break_even", "x:")):
                seconds = [row[rule][f"{arm}_queued_s"] or float("nan") for row in rows]
                axis.plot(seconds, style, color=f"C{colour}", label=f"{arm} ({rule})")
        label_mixes(axis, rows, ylabel="mean TTFT, queued (s, projected)", title=name, yscale="log")
    figure.suptitle(
        f"{report['gpu']['device']}, {report['gpu']['model']}: " + report["command"], fontsize=7
    )
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)
    return out


def resummarise(report: dict[str, Any]) -> None:
    """A saved run's ratios and ranges again, from its times (`--summary-only`)."""
    for name, index in (("synthetic", "by_mix"), ("mooncake", "by_budget")):
        rows = report.get(name, {}).get("rows", [])
        for row in rows:
            for rule in RULES:
                row[rule] = ratios(row[rule], report["load"])
        if rows:
            report[name][index] = {mix_key(row): row for row in rows}
    summarise(report)


def main() -> None:
    parser = trace_arguments(__doc__.split("\n")[0], "0.25,0.5", "0.1,0.25")
    parser.add_argument("--gpu-report", type=Path, default=GPU_REPORT)
    parser.add_argument("--model", default="llama3_8b", help="a model of --gpu-report")
    parser.add_argument("--method", default="question_attention@0.15", help="selector@ratio")
    parser.add_argument("--backend", default="flashinfer")
    parser.add_argument(
        "--disk-gb-per-s", type=float, default=3.0, help="disk tier read rate (assumed)"
    )
    parser.add_argument("--load", type=float, default=0.8, help="x the full prefill's capacity")
    parser.add_argument("--out", type=Path, default=RESULTS / "chunk_retention_projection.json")
    parser.add_argument(
        "--summary-only", action="store_true", help="redo --out's ratios and ranges from its times"
    )
    args = parser.parse_args()
    if redo_saved_report(args, plot, resummarise):
        return
    if not 0 < args.load < 1:
        parser.error(f"--load must be in (0, 1), got {args.load}")
    gpu = json.loads(args.gpu_report.read_text())
    times = FusedPrefillTimes.from_gpu_benchmark(
        gpu, args.model, args.method, args.backend, args.disk_gb_per_s * 1e9, BREAK_EVEN
    )
    (model,) = [m for m in gpu["models"] if m["name"] == args.model]
    kv_bytes = 2 * model["layers"] * model["kv_heads"] * model["head_dim"] * 2  # fp16 K and V
    report: dict[str, Any] = {
        **report_header("benchmarks.chunk_retention_projection"),
        "gpu": {
            "report": args.gpu_report.name,
            "device": gpu["device"],
            "model": args.model,
            "method": args.method,
            "backend": args.backend,
            "lengths": times.lengths,
            "full_s": times.full_s,
            "fused_s": times.fused_s,
            "h2d_gb_per_s": round(times.h2d_bytes_per_s / 1e9, 2),
        },
        "kv_bytes_per_token": kv_bytes,
        "disk_gb_per_s_assumed": args.disk_gb_per_s,
        "load": args.load,
        "min_matched_share": BREAK_EVEN,
    }
    measure_mix = lambda *mix: project(*mix, times, kv_bytes, args.load)  # noqa: E731
    write_trace_report(report, args, measure_mix, summarise, plot)


if __name__ == "__main__":
    main()
