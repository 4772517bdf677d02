"""Study: can a fused prefill tell, from what it computes anyway, that its answer will differ
from the full prefill's? (issue 41, the per-request guard's premise)

Reads retention-harness results (`benchmarks/fusion_retention.py`, which records each method's
signals from `fusion/fidelity_signals.py`) and, for one method (the operating point a guard
would start from), ranks every signal against the labels: AUROC for "the answer differs from
the full prefill's" (0.5: no signal; above: a higher value means a likelier difference; below:
the reverse) with a 95 % bootstrap interval, and Spearman's rank correlation with the
teacher-forced KL and with 1 - token agreement. Rows that carry the full prefill's own
first-token signals (`full_signals`) add them as `full:*`, the control. A signal a guard could use reads AUROC >= 0.7
(or <= 0.3) on the evaluation questions; choices (which signal, which threshold) are made on the
seed-7 dev questions only.

    python -m research.fidelity_signals_study benchmarks/results/fidelity_signals_qwen.json \
        --method question_attention+sink8+prefix@0.15
-> research/results/fidelity_signals_<stem>.json and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

RESULTS = Path(__file__).resolve().parent / "results"
BOOTSTRAP_SEED = 0


def auroc(scores: np.ndarray, positive: np.ndarray) -> float:
    """P(score of a positive > score of a negative), ties counted half (Mann-Whitney U)."""
    pos, neg = scores[positive], scores[~positive]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    u = stats.mannwhitneyu(pos, neg, alternative="two-sided").statistic
    return float(u / (len(pos) * len(neg)))


def auroc_interval(scores: np.ndarray, positive: np.ndarray) -> tuple[float, float]:
    if positive.all() or not positive.any():
        return float("nan"), float("nan")
    result = stats.bootstrap(
        (scores, positive),
        lambda s, p: auroc(s, p.astype(bool)),
        paired=True,
        vectorized=False,
        n_resamples=999,
        method="percentile",
        random_state=np.random.default_rng(BOOTSTRAP_SEED),
    )
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def study(rows: list[dict[str, Any]], method: str) -> dict[str, Any]:
    runs = []
    for row in rows:
        run = row["methods"].get(method)
        if not run or not run.get("signals"):
            continue
        # The control: the full prefill's own first-token signals, where the row has them (is
        # an uncertain fused prefill fusion's doing, or a question the model is unsure of?).
        full = row.get("full_signals") or {}
        control = {f"full:{k}": v for k, v in full.items() if k.startswith("first_token")}
        runs.append({**run, "signals": {**run["signals"], **control}})
    if not runs:
        raise SystemExit(f"no row of {method!r} carries signals (rerun the harness)")
    differs = np.array([not run["agree"] for run in runs])
    kl = np.array([run["kl"] for run in runs])
    disagreement = np.array([1.0 - run["token_agreement"] for run in runs])
    names = sorted({name for run in runs for name in run["signals"]})
    table = []
    for name in names:
        present = np.array([name in run["signals"] for run in runs])
        values = np.array([run["signals"].get(name, np.nan) for run in runs], dtype=float)
        values, label = values[present], differs[present]
        low, high = auroc_interval(values, label)
        table.append(
            {
                "signal": name,
                "questions": int(present.sum()),
                "auroc_differs": auroc(values, label),
                "auroc_interval": [low, high],
                "spearman_kl": float(stats.spearmanr(values, kl[present]).statistic),
                "spearman_disagreement": float(
                    stats.spearmanr(values, disagreement[present]).statistic
                ),
            }
        )
    table.sort(key=lambda r: -abs(r["auroc_differs"] - 0.5))
    return {
        "method": method,
        "questions": len(runs),
        "answers_differ": int(differs.sum()),
        "signals": table,
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"{report['method']}: {report['questions']} questions, "
        f"{report['answers_differ']} answers differ from the full prefill's",
        "",
        "| signal | AUROC (answer differs) [95 %] | Spearman vs KL | vs 1 - token agreement |",
        "|---|---|---|---|",
    ]
    for r in report["signals"]:
        low, high = r["auroc_interval"]
        lines.append(
            f"| `{r['signal']}` | {r['auroc_differs']:.2f} [{low:.2f}, {high:.2f}] | "
            f"{r['spearman_kl']:.2f} | {r['spearman_disagreement']:.2f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a fusion_retention results JSON")
    parser.add_argument("--method", default="question_attention+sink8+prefix@0.15")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = json.loads(args.results.read_text())["rows"]
    report = {"results": str(args.results), **study(rows, args.method)}
    out = args.out or RESULTS / f"fidelity_signals_{args.results.stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
