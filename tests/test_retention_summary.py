"""A retention run's summary (evaluation/retention.py): answers kept and gained, per-method
question sets, and the quality floor's ratio curve (tuning/ratio/quality_floor.py)."""

from __future__ import annotations

from typing import Any

import pytest

from sglang_hicache_ext.evaluation.retention import summarise
from sglang_hicache_ext.tuning.ratio.quality_floor import ratio_curve

# bootstrap intervals of four questions are degenerate by construction
pytestmark = pytest.mark.filterwarnings("ignore::scipy.stats.DegenerateDataWarning")


def _row(f1_full: float, methods: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """A question's row; each method given as (F1, teacher-forced KL)."""
    runs = {
        name: {
            "f1": f1,
            "kl": kl,
            "first_kl": kl,
            "agree": f1 == f1_full,
            "prefill_s": 1.0,
            "answer": "",
        }
        for name, (f1, kl) in methods.items()
    }
    return {"f1_full": f1_full, "full_prefill_s": 4.0, "methods": runs}


ROWS = [
    _row(1.0, {"reuse": (0.0, 0.8), "a3@0.15": (1.0, 0.2), "a3@0.3": (1.0, 0.1)}),
    _row(1.0, {"reuse": (1.0, 0.4), "a3@0.15": (0.0, 0.3), "a3@0.3": (1.0, 0.1)}),
    _row(0.0, {"reuse": (1.0, 0.6), "a3@0.15": (0.0, 0.1)}),
    _row(0.6, {"reuse": (0.6, 0.2), "a3@0.15": (0.6, 0.2)}),
]


def test_answers_kept_counts_only_what_the_full_prefill_answered() -> None:
    summary = summarise(ROWS, ["reuse", "a3@0.15", "a3@0.3"])
    reuse, fused = summary["reuse"], summary["a3@0.15"]
    assert reuse["answered_by_full"] == 3 and reuse["kept"] == pytest.approx(2 / 3)
    assert reuse["gained"] == 1  # the question only reuse answers: luck, not kept
    assert fused["kept"] == pytest.approx(2 / 3) and fused["gained"] == 0
    assert fused["retention"] == pytest.approx(1.6 / 2.6)
    assert fused["kl_gap_closed"] == pytest.approx(1 - 0.8 / 2.0)


def test_each_method_is_summarised_over_the_questions_it_has() -> None:
    summary = summarise(ROWS, ["reuse", "a3@0.15", "a3@0.3"])
    assert summary["full"]["questions"] == 4
    assert summary["a3@0.3"]["questions"] == 2
    assert summary["a3@0.3"]["retention"] == 1.0 and summary["a3@0.3"]["kept"] == 1.0


def test_ratio_curve_collects_one_selector_in_ratio_order() -> None:
    curve = ratio_curve(summarise(ROWS, ["reuse", "a3@0.3", "a3@0.15"]), "a3")
    assert [point.ratio for point in curve] == [0.15, 0.3]
    assert [point.questions for point in curve] == [4, 2]
