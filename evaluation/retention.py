"""F1 retention of fused answers against the full prefill's, per method, over the questions it has.

The summary of a retention run (`benchmarks/fusion_retention.py`): rows of per-question answers,
each method's token F1, teacher-forced and first-token KL and prefill time beside the full
prefill's. F1 retention = mean F1 / mean F1 of the full prefill with a 95 % paired bootstrap
interval (scipy.stats.bootstrap, BCa; percentile where BCa degenerates); answers kept (of the
questions the full prefill answers, F1 >= 0.5) and gained; agreement with the full prefill's
answer; token agreement (the live shadow check's measure) with its interval and first-token
agreement; teacher-forced KL and the share of reuse's KL it closes, with its interval; median
prefill-time ratio. The ratio tuner's quality floor is read from it
(`tuning/ratio/quality_floor.py: ratio_curve`).
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np
from scipy.stats import bootstrap

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
    """Per method over the questions that have it (and reuse, for the paired KL gap, when the
    run measured reuse at all): a ratio curve may cover fewer questions than the methods
    compared at one ratio."""
    summary: dict[str, dict[str, Any]] = {
        "full": {
            "questions": len(rows),
            "f1": float(np.mean([row["f1_full"] for row in rows])),
            "retention": 1.0,
            "agree": 1.0,
        }
    }
    paired = any("reuse" in row["methods"] for row in rows)
    for method in methods:
        have = [
            row
            for row in rows
            if method in row["methods"] and (not paired or "reuse" in row["methods"])
        ]
        runs = [row["methods"][method] for row in have]
        f1_full = np.array([row["f1_full"] for row in have])
        f1 = np.array([run["f1"] for run in runs])
        kl = np.array([run["kl"] for run in runs])
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
            **_answers_kept(f1_full, f1),
            **_token_agreement(runs),
        }
        if paired:
            kl_reuse = np.array([row["methods"]["reuse"]["kl"] for row in have])
            summary[method]["kl_gap_closed"] = float(1 - kl.mean() / kl_reuse.mean())
            summary[method]["kl_gap_closed_ci95"] = _interval(
                (kl, kl_reuse), lambda a, b: 1 - a.mean() / b.mean()
            )
    return summary


def _token_agreement(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The live shadow check's measure (evaluation/token_agreement.py), where the rows have it
    (files written before it was measured do not)."""
    if not runs or not all("token_agreement" in run for run in runs):
        return {}
    shares = np.array([run["token_agreement"] for run in runs])
    firsts = np.array([float(run["first_token_agree"]) for run in runs])
    return {
        "token_agreement": float(shares.mean()),
        "token_agreement_ci95": _interval((shares,), np.mean),
        "first_token_agreement": float(firsts.mean()),
    }


def _answers_kept(f1_full: np.ndarray, f1: np.ndarray) -> dict[str, Any]:
    answered = f1_full >= ANSWERED_F1
    kept = (f1[answered] >= ANSWERED_F1).astype(float)
    return {
        "answered_by_full": int(answered.sum()),
        "kept": float(kept.mean()) if len(kept) else float("nan"),
        "kept_ci95": _interval((kept,), np.mean) if len(kept) else [float("nan")] * 2,
        "gained": int((f1[~answered] >= ANSWERED_F1).sum()),
    }
