"""Probe queries of the placement's profiler and the quality they measure (EvicPress §4.2).

A chunk's probes are the questions real requests asked with it (recorded by `ChunkUsage`),
then templated questions up to the count. A probe prompt is a short lead text, the chunk, then
the question: the lead keeps the chunk out of the exact prefix a registration (or an earlier
round's probe that fell back) left in the prefix tree, so the chunk's stored rows are what the
probe reads. The quality of a codec is the
mean token F1 of its greedy answers against the answers from the chunk's registered rows
(`evaluation.answer_quality.mean_answer_f1`).
"""

from __future__ import annotations

from collections.abc import Sequence

PROBE_LEAD = "Context {round}:\n"  # formatted with the round's number
TEMPLATE_QUESTIONS = (
    "What is this passage about?",
    "Which names, places, dates or numbers does the passage mention?",
)
PROBES_PER_CHUNK = 2
ANSWER_TOKENS = 16


def template_question(question: str) -> str:
    """The text after the chunk in a templated probe (a RAG prompt's usual tail)."""
    return f"\n\nQuestion: {question}\nAnswer:"


def probe_questions(
    recorded: Sequence[Sequence[int]],
    templates: Sequence[Sequence[int]],
    count: int = PROBES_PER_CHUNK,
) -> list[list[int]]:
    """Token ids of the questions a chunk is probed with: recorded real ones first."""
    if count <= 0:
        raise ValueError(f"count must be positive, got {count}")
    chosen = [list(q) for q in reversed(recorded)][:count]  # the most recent first
    return chosen + [list(t) for t in templates[: count - len(chosen)]]
