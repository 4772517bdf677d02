"""Answer-quality metrics against hand-computed values."""

from __future__ import annotations

import pytest

from sglang_hicache_ext.evaluation.answer_quality import (
    embedding_similarity,
    f1_score,
    normalize_answer,
)
from sglang_hicache_ext.evaluation.hotpotqa import load_hotpotqa


def test_normalisation_and_f1() -> None:
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert f1_score("the Eiffel Tower", "Eiffel Tower") == 1.0
    assert f1_score("Eiffel", "Eiffel Tower") == pytest.approx(2 * 1.0 * 0.5 / 1.5)
    assert f1_score("yes", "no") == 0.0 and f1_score("Yes.", "yes") == 1.0
    assert f1_score("Paris", "London") == 0.0


def test_embedding_similarity_orders_paraphrases_above_unrelated() -> None:
    same, paraphrase, unrelated = embedding_similarity(
        ["The answer is Paris.", "Paris is the answer", "Photosynthesis needs light."],
        ["The answer is Paris.", "The answer is Paris.", "The answer is Paris."],
    )
    assert same == pytest.approx(1.0, abs=1e-5)
    assert paraphrase > 0.8 > 0.3 > unrelated


def test_hotpotqa_context_keeps_the_supporting_paragraphs() -> None:
    """The demo's and the quality benchmark's prompts: every supporting paragraph, then
    distractors, however far down the dataset's order the supporting ones stand."""
    for example in load_hotpotqa(20, seed=7):
        context = example.context(4)
        titles = [paragraph.split(":", 1)[0] for paragraph in context]
        assert len(context) == 4 and set(context) <= set(example.documents)
        assert titles[: len(example.supporting_titles)] == [
            t for t in titles if t in example.supporting_titles
        ]
        assert set(example.supporting_titles) <= set(titles)
