"""Study: would a per-request guard beat the fixed ratios? (issue 41, before building one)

A guard runs the fused prefill at a low ratio and, where a signal the prefill computes anyway
flags the request, redoes it at a higher ratio. Its outcome per question is then exactly one of
two measured runs, so its whole frontier can be read off retention-harness results that hold
both ratios and the start's signals: for every threshold (every share of requests escalated),
the mean recompute share paid (the start's ratio, plus the higher one for each redo) against the
fidelity bought (whole-answer and token agreement, KL gap closed against `reuse`). Beside it:
the fixed ratios in the same file, and the oracle guard that escalates exactly the answers that
differ (no signal does better). Thresholds are swept over the evaluation questions themselves,
which flatters the guard: a curve that does not dominate here will not once its threshold is
chosen on the dev questions.

    python -m research.guard_frontier benchmarks/results/fidelity_default_qwen.json \
        --start question_attention+sink8+prefix@0.15 --escalate question_attention+sink8+prefix@0.5 \
        --signal first_token_margin --risky low
-> research/results/guard_frontier_<stem>.json and a markdown summary on stdout.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def ratio_of(method: str) -> float:
    """The recompute ratio a harness method name carries (`reuse`: 0, `full`: 1)."""
    if method == "reuse":
        return 0.0
    if method == "full":
        return 1.0
    found = re.search(r"@([0-9.]+)", method)
    if found is None:
        raise SystemExit(f"no ratio in method name {method!r}")
    return float(found.group(1))


def fidelity(agree: np.ndarray, tokens: np.ndarray, kl: np.ndarray, kl_reuse: float) -> dict:
    return {
        "whole_answer": float(agree.mean()),
        "token_agreement": float(tokens.mean()),
        "kl_gap_closed": float(1 - kl.mean() / kl_reuse),
    }


def frontier(
    rows: list[dict[str, Any]],
    start: str,
    escalate: str,
    signal: str,
    risky: str,
    in_place: bool = False,
) -> dict[str, Any]:
    """The guard's curve; `in_place`: an escalation pays only the difference of the ratios (a
    signal known before any token is recomputed, e.g. from the scoring pass), not a redo."""
    wanted = ("reuse", start, escalate)
    rows = [r for r in rows if all(m in r["methods"] for m in wanted)]
    rows = [r for r in rows if signal in (r["methods"][start].get("signals") or {})]
    if not rows:
        raise SystemExit(f"no row holds reuse, {start}, {escalate} and the signal {signal!r}")

    def column(method: str, key: str) -> np.ndarray:
        return np.array([float(r["methods"][method][key]) for r in rows])

    kl_reuse = float(column("reuse", "kl").mean())
    low, high = ratio_of(start), ratio_of(escalate)
    extra = high - low if in_place else high
    runs = {m: (column(m, "agree"), column(m, "token_agreement"), column(m, "kl")) for m in wanted}
    values = np.array([r["methods"][start]["signals"][signal] for r in rows], dtype=float)
    risk = -values if risky == "low" else values  # higher: escalate first
    order = np.argsort(-risk, kind="stable")
    curve = []
    for count in range(len(rows) + 1):
        escalated = np.zeros(len(rows), dtype=bool)
        escalated[order[:count]] = True
        mixed = [
            np.where(escalated, e, s) for s, e in zip(runs[start], runs[escalate], strict=True)
        ]
        curve.append(
            {
                "escalated": count / len(rows),
                "cost": low + extra * count / len(rows),
                **fidelity(*mixed, kl_reuse),
            }
        )
    differs = ~runs[start][0].astype(bool)
    oracle = [np.where(differs, e, s) for s, e in zip(runs[start], runs[escalate], strict=True)]
    fixed = {
        m: {"cost": ratio_of(m), **fidelity(*runs[m], kl_reuse)} for m in dict.fromkeys(wanted)
    }
    return {
        "questions": len(rows),
        "start": start,
        "escalate": escalate,
        "signal": signal,
        "risky": risky,
        "cost_model": "recompute share: the start's ratio, plus for each escalation "
        + (
            "the difference to the higher ratio (in place)"
            if in_place
            else "the higher ratio (a redo)"
        ),
        "fixed": fixed,
        "oracle": {
            "escalated": float(differs.mean()),
            "cost": low + extra * float(differs.mean()),
            **fidelity(*oracle, kl_reuse),
        },
        "curve": curve,
        "cheapest_at_escalate_fidelity": cheapest(curve, fixed[escalate]["whole_answer"]),
    }


def cheapest(curve: list[dict[str, float]], whole_answer: float) -> dict[str, float] | None:
    """The cheapest point of the curve whose whole-answer agreement reaches `whole_answer`."""
    reaching = [p for p in curve if p["whole_answer"] >= whole_answer - 1e-12]
    return min(reaching, key=lambda p: p["cost"]) if reaching else None


def markdown(report: dict[str, Any]) -> str:
    def line(name: str, p: dict[str, float]) -> str:
        return (
            f"| {name} | {p['cost']:.3f} | {p['whole_answer']:.2f} | {p['token_agreement']:.3f} "
            f"| {p['kl_gap_closed']:.2f} |"
        )

    lines = [
        f"{report['questions']} questions; guard: {report['start']} -> {report['escalate']} "
        f"where `{report['signal']}` is {report['risky']}; cost: {report['cost_model']}",
        "",
        "| point | mean recompute share | whole answer | token agreement | KL gap closed |",
        "|---|---|---|---|---|",
    ]
    lines += [line(f"fixed `{m}`", p) for m, p in report["fixed"].items()]
    for share in (0.1, 0.2, 0.3, 0.4, 0.5):
        point = min(report["curve"], key=lambda p: abs(p["escalated"] - share))
        lines.append(line(f"guard, {point['escalated']:.2f} escalated", point))
    lines.append(
        line(f"oracle guard, {report['oracle']['escalated']:.2f} escalated", report["oracle"])
    )
    best = report["cheapest_at_escalate_fidelity"]
    if best is not None:
        lines.append(line("guard, cheapest at the higher ratio's whole answer", best))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a fusion_retention results JSON")
    parser.add_argument("--start", default="question_attention+sink8+prefix@0.15")
    parser.add_argument("--escalate", default="question_attention+sink8+prefix@0.5")
    parser.add_argument("--signal", default="first_token_margin")
    parser.add_argument("--risky", choices=("low", "high"), default="low")
    parser.add_argument(
        "--in-place", action="store_true", help="escalation pays the ratios' difference, no redo"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = json.loads(args.results.read_text())["rows"]
    report = {
        "results": str(args.results),
        **frontier(rows, args.start, args.escalate, args.signal, args.risky, args.in_place),
    }
    out = args.out or RESULTS / f"guard_frontier_{args.results.stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
