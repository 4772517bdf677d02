"""The table and figure of a `benchmarks/fusion_retention.py` run's summary.

The summary itself (F1 retention, answers kept, KL gap closed, with their intervals) is
`evaluation/retention.py: summarise`; a selector's ratio curve, `tuning/ratio/quality_floor.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def print_table(summary: dict[str, dict[str, Any]]) -> None:
    """The summary as the markdown table the docs show."""
    print(
        "| method | questions | F1 | F1 retention [95 % CI] | answers kept [95 % CI] | gained "
        "| agrees with full | token agreement [95 % CI] | teacher-forced KL | KL gap closed [95 % CI] "
        "| prefill time ÷ full |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
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
        tokens = "1.00" if "retention_ci95" not in v else ""
        if "token_agreement" in v:
            low, high = v["token_agreement_ci95"]
            tokens = f"{v['token_agreement']:.2f} [{low:.2f}, {high:.2f}]"
        print(
            f"| `{method}` | {v['questions']} | {v['f1']:.3f} | {retention} | {kept} | {gained} "
            f"| {v['agree']:.2f} | {tokens} "
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
