"""The summary of a `benchmarks/fusion_retention.py` run: per method, over the questions it has.

F1 retention = mean F1 / mean F1 of the full prefill with a 95 % paired bootstrap interval
(scipy.stats.bootstrap, BCa; percentile where BCa degenerates); answers kept (of the questions
the full prefill answers, F1 >= 0.5) and gained; agreement with the full prefill's answer;
teacher-forced KL and the share of reuse's KL it closes, with its interval; median prefill-time
ratio. `ratio_curve` is one selector's retention over the ratios measured (the quality floor).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import bootstrap

from sglang_hicache_ext.tuning.ratio.quality_floor import CurvePoint

ANSWERED_F1 = 0.5  # a question counts as answered from this token F1 on


def _interval(samples: tuple[np.ndarray, ...], statistic: Any) -> list[float]:
    identical = len(samples) > 1 and all(np.array_equal(samples[0], o) for o in samples[1:])
    if len(samples[0]) < 3 or identical or np.ptp(np.concatenate(samples)) == 0:
        value = float(statistic(*samples))
        return [value, value]
    # BCa needs a non-degenerate jackknife; many equal F1 values (0 or 1) can defeat it, and
    # then the percentile interval is the honest fallback.
    for method in ("BCa", "percentile"):
        result = bootstrap(
            samples,
            statistic,
            paired=True,
            vectorized=False,
            n_resamples=2000,
            confidence_level=0.95,
            method=method,
            random_state=0,
        )
        if not np.isnan(result.confidence_interval.low):
            break
    return [float(result.confidence_interval.low), float(result.confidence_interval.high)]


def summarise(rows: list[dict[str, Any]], methods: list[str]) -> dict[str, dict[str, Any]]:
    """Per method over the questions that have it (and reuse, for the paired KL gap): a ratio
    curve may cover fewer questions than the methods compared at one ratio."""
    summary: dict[str, dict[str, Any]] = {
        "full": {
            "questions": len(rows),
            "f1": float(np.mean([row["f1_full"] for row in rows])),
            "retention": 1.0,
            "agree": 1.0,
        }
    }
    for method in methods:
        have = [row for row in rows if method in row["methods"] and "reuse" in row["methods"]]
        runs = [row["methods"][method] for row in have]
        f1_full = np.array([row["f1_full"] for row in have])
        f1 = np.array([run["f1"] for run in runs])
        kl = np.array([run["kl"] for run in runs])
        kl_reuse = np.array([row["methods"]["reuse"]["kl"] for row in have])
        summary[method] = {
            "questions": len(have),
            "f1_full": float(f1_full.mean()),
            "f1": float(f1.mean()),
            "retention": float(f1.mean() / f1_full.mean()),
            "retention_ci95": _interval((f1, f1_full), lambda a, b: a.mean() / b.mean()),
            "agree": statistics.mean(run["agree"] for run in runs),
            "kl": float(kl.mean()),
            "first_kl": statistics.mean(run["first_kl"] for run in runs),
            "prefill_ratio": statistics.median(
                run["prefill_s"] / row["full_prefill_s"]
                for run, row in zip(runs, have, strict=True)
            ),
            "kl_gap_closed": float(1 - kl.mean() / kl_reuse.mean()),
            "kl_gap_closed_ci95": _interval((kl, kl_reuse), lambda a, b: 1 - a.mean() / b.mean()),
            **_answers_kept(f1_full, f1),
        }
    return summary


def _answers_kept(f1_full: np.ndarray, f1: np.ndarray) -> dict[str, Any]:
    answered = f1_full >= ANSWERED_F1
    kept = (f1[answered] >= ANSWERED_F1).astype(float)
    return {
        "answered_by_full": int(answered.sum()),
        "kept": float(kept.mean()) if len(kept) else float("nan"),
        "kept_ci95": _interval((kept,), np.mean) if len(kept) else [float("nan")] * 2,
        "gained": int((f1[~answered] >= ANSWERED_F1).sum()),
    }


def ratio_curve(summary: dict[str, dict[str, Any]], selector: str) -> tuple[CurvePoint, ...]:
    """F1 retention of `selector` (e.g. "a3+sink4") at every ratio the summary measured."""
    curve = []
    for method, values in summary.items():
        name, _, ratio = method.partition("@")
        if name == selector and ratio.replace(".", "", 1).isdigit():  # no codec, no eviction
            low, high = values["retention_ci95"]
            curve.append(
                CurvePoint(float(ratio), values["retention"], (low, high), values["questions"])
            )
    return tuple(sorted(curve))


def print_table(summary: dict[str, dict[str, Any]]) -> None:
    """The summary as the markdown table the docs show."""
    print(
        "| method | questions | F1 | F1 retention [95 % CI] | answers kept [95 % CI] | gained "
        "| agrees with full | teacher-forced KL | KL gap closed [95 % CI] | prefill time ÷ full |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for method, v in summary.items():
        ci = v.get("retention_ci95", [1.0, 1.0])
        retention = f"{v['retention']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"
        gap = ""
        if "kl_gap_closed" in v:
            low, high = v["kl_gap_closed_ci95"]
            gap = f"{v['kl_gap_closed']:.2f} [{low:.2f}, {high:.2f}]"
        kl = f"{v['kl']:.4f}" if "kl" in v else "0"
        kept = "1.00" if "kept" not in v else f"{v['kept']:.2f} [{v['kept_ci95'][0]:.2f}, "
        kept += "" if "kept" not in v else f"{v['kept_ci95'][1]:.2f}] of {v['answered_by_full']}"
        gained = str(v.get("gained", 0))
        time_ratio = f"{v.get('prefill_ratio', 1.0):.2f}"
        print(
            f"| `{method}` | {v['questions']} | {v['f1']:.3f} | {retention} | {kept} | {gained} "
            f"| {v['agree']:.2f} "
            f"| {kl} | {gap} | {time_ratio} |"
        )


def plot_methods(data: dict[str, Any], methods: list[str], out: Path) -> Path | None:
    """Per method: teacher-forced KL gap closed and answers kept, each with its 95 % interval,
    and agreement with the full prefill's answer (the noise floor's as a line, when measured)."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    summary = data["summary"]
    methods = [m for m in methods if m in summary]
    if not methods:
        return None
    figure, panels = plt.subplots(1, 3, figsize=(15, 0.42 * len(methods) + 1.6), dpi=110)
    ys = np.arange(len(methods))
    for axes, key, label in zip(
        panels,
        ("kl_gap_closed", "kept", "agree"),
        ("teacher-forced KL gap closed", "answers kept", "agrees with the full answer"),
        strict=True,
    ):
        values = [summary[m][key] for m in methods]
        intervals = [summary[m].get(f"{key}_ci95") for m in methods]
        errors = None
        if all(interval is not None for interval in intervals):
            errors = [
                [v - lo for v, (lo, _) in zip(values, intervals, strict=True)],
                [hi - v for v, (_, hi) in zip(values, intervals, strict=True)],
            ]
        axes.barh(ys, values, xerr=errors, color="tab:blue", alpha=0.75, capsize=3)
        if key == "agree" and "full+batch" in summary:
            axes.axvline(summary["full+batch"]["agree"], color="black", linestyle=":", linewidth=1)
        axes.set_yticks(ys, methods if key == "kl_gap_closed" else [""] * len(methods), fontsize=7)
        axes.invert_yaxis()
        axes.set_xlabel(f"{label} (n = questions each method has)", fontsize=8)
        axes.grid(axis="x", alpha=0.3)
    figure.suptitle(
        f"{data['model']} ({data.get('dtype', 'float32')}): fidelity per method "
        "(benchmarks/fusion_retention.py)",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(out)
    plt.close(figure)
    return out
