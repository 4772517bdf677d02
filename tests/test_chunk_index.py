"""Chunk index: matches at any offset and order, robust to edge tokens that differ in context."""

from __future__ import annotations

import random

import pytest

from sglang_hicache_ext.radix.chunk_index import ChunkIndex, ChunkMatch


def _random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 30000) for _ in range(n)]


@pytest.fixture
def chunks() -> dict[str, list[int]]:
    rng = random.Random(0)
    return {f"doc{i}": _random_tokens(rng, 60 + 10 * i) for i in range(4)}


@pytest.fixture
def index(chunks: dict[str, list[int]]) -> ChunkIndex:
    idx = ChunkIndex()
    for chunk_id, tokens in chunks.items():
        idx.add(chunk_id, tokens)
    return idx


def test_shuffled_chunks_with_glue_are_found_exactly(index: ChunkIndex, chunks) -> None:
    rng = random.Random(1)
    order = ["doc2", "doc0", "doc3"]
    prompt: list[int] = _random_tokens(rng, 5)
    expected = []
    for chunk_id in order:
        expected.append(ChunkMatch(chunk_id, len(prompt), 0, len(chunks[chunk_id])))
        prompt += chunks[chunk_id] + _random_tokens(rng, 3)
    prompt += _random_tokens(rng, 12)  # the question
    assert index.find(prompt) == expected


def test_edge_tokens_tokenized_differently_still_match_the_interior(
    index: ChunkIndex, chunks
) -> None:
    doc = chunks["doc1"]
    # In context the first and last two tokens merged with neighbouring text.
    prompt = [7, 8, 99999] + doc[1:-2] + [88888, 9]
    (match,) = index.find(prompt)
    assert match == ChunkMatch("doc1", prompt_start=3, chunk_start=1, length=len(doc) - 3)
    assert prompt[match.prompt_start : match.prompt_end] == doc[match.chunk_start : match.chunk_end]


def test_the_same_chunk_twice_and_unregistered_text(index: ChunkIndex, chunks) -> None:
    rng = random.Random(2)
    doc = chunks["doc0"]
    prompt = doc + _random_tokens(rng, 40) + doc
    matches = index.find(prompt)
    assert [(m.chunk_id, m.prompt_start, m.length) for m in matches] == [
        ("doc0", 0, len(doc)),
        ("doc0", len(doc) + 40, len(doc)),
    ]
    assert index.find(_random_tokens(rng, 200)) == []


def test_short_accidental_overlap_is_not_a_match(index: ChunkIndex, chunks) -> None:
    doc = chunks["doc3"]
    prompt = [1, 2, 3] + doc[10:30] + [4, 5, 6]  # 20 of 90 tokens: below min_coverage 0.5
    assert index.find(prompt) == []


def test_registration_is_idempotent_and_removable(index: ChunkIndex, chunks) -> None:
    index.add("doc0", chunks["doc0"])
    assert len(index) == 4
    with pytest.raises(ValueError, match="already registered with other tokens"):
        index.add("doc0", chunks["doc1"])
    index.remove("doc0")
    assert "doc0" not in index
    assert index.find(chunks["doc0"]) == []
    assert [m.chunk_id for m in index.find(chunks["doc1"])] == ["doc1"]
    with pytest.raises(KeyError):
        index.remove("doc0")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"anchor_tokens": 1}, "anchor_tokens"), ({"min_coverage": 0.0}, "min_coverage")],
)
def test_bad_parameters(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ChunkIndex(**kwargs)


def test_too_short_chunk_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 8 are needed"):
        ChunkIndex().add("tiny", [1, 2, 3])


def test_real_tokenizer_boundary_effects(tiny_llama_path) -> None:
    """Documents tokenized alone vs inside a prompt with a real BPE tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    docs = {
        "a": "The object returned by the function is a path that can be joined with other paths.",
        "b": "Each argument is parsed and checked against the declared type before the call returns.",
    }
    index = ChunkIndex(anchor_tokens=4)
    for chunk_id, text in docs.items():
        index.add(chunk_id, tokenizer.encode(text, add_special_tokens=False))
    prompt_text = f"Context:\n{docs['b']}\n\n{docs['a']}\nQuestion: what is returned?"
    prompt = tokenizer.encode(prompt_text, add_special_tokens=False)
    matches = index.find(prompt)
    assert [m.chunk_id for m in matches] == ["b", "a"]
    for match in matches:
        chunk_tokens = index.tokens(match.chunk_id)
        assert match.length >= len(chunk_tokens) - 2  # at most the edge tokens differ
