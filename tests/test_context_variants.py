"""The rows shadow checks keep per document set (`chunk_fusion/context_variants.py`): keyed by
the set in no order and the matched span, bounded in bytes (least recently
read first out), and dropped with any document of their set. Kept and read through a real server:
tests/test_server_auto_chunks.py."""

from __future__ import annotations

import torch

from sglang_hicache_ext.fusion.chunk import PrecomputedChunk
from sglang_hicache_ext.radix.chunk_index import ChunkMatch
from sglang_hicache_ext.sglang_ext.chunk_fusion.context_variants import (
    ContextVariants,
    document_set,
)


def _rows(num_tokens: int) -> PrecomputedChunk:
    keys = tuple(torch.randn(num_tokens, 2, 4) for _ in range(2))
    values = tuple(torch.randn(num_tokens, 2, 4) for _ in range(2))
    return PrecomputedChunk(tuple(range(num_tokens)), keys, values, torch.zeros(2, num_tokens))


def _match(chunk_id: str, start: int = 0, length: int = 10, at: int = 3) -> ChunkMatch:
    return ChunkMatch(chunk_id, prompt_start=at, chunk_start=start, length=length)


def _set(*chunk_ids: str) -> frozenset[str]:
    return frozenset(chunk_ids)


def test_variants_are_found_by_document_set_in_any_order_and_by_span() -> None:
    variants = ContextVariants(capacity_bytes=1 << 20)
    rows = _rows(10)
    kept = document_set([_match("a"), _match("b", at=20)])
    assert variants.keep(kept, _match("a"), rows)
    assert variants.get(document_set([_match("b"), _match("a", at=20)]), _match("a")) is rows
    assert variants.get(document_set([_match("a"), _match("c", at=20)]), _match("a")) is None
    assert variants.get(document_set([_match("a")]), _match("a")) is None
    # Another span of the same chunk (its label left out in this prompt) is not these rows.
    assert variants.get(kept, _match("a", 3, 7)) is None
    assert variants.stats()["used"] == 1


def test_capacity_evicts_the_least_recently_read_and_refuses_what_cannot_fit() -> None:
    one = _rows(10).nbytes
    variants = ContextVariants(capacity_bytes=2 * one)
    sets = [_set(name) for name in "abc"]
    for documents, name in zip(sets[:2], "ab", strict=True):
        variants.keep(documents, _match(name), _rows(10))
    assert variants.get(sets[0], _match("a")) is not None  # read: now the most recent
    variants.keep(sets[2], _match("c"), _rows(10))
    assert variants.get(sets[1], _match("b")) is None
    assert variants.get(sets[0], _match("a")) is not None
    assert variants.bytes_used == 2 * one and variants.stats()["evicted"] == 1
    assert not variants.keep(_set("d"), _match("d", length=30), _rows(30))
    assert variants.stats()["too_large"] == 1 and variants.bytes_used == 2 * one


def test_the_same_span_kept_again_replaces_its_rows() -> None:
    variants = ContextVariants(capacity_bytes=1 << 20)
    documents = _set("a", "b")
    variants.keep(documents, _match("a"), _rows(10))
    newer = _rows(10)
    variants.keep(documents, _match("a"), newer)
    assert variants.get(documents, _match("a")) is newer
    assert variants.stats()["variants"] == 1 and variants.bytes_used == newer.nbytes


def test_forgetting_a_document_drops_every_variant_of_its_sets() -> None:
    variants = ContextVariants(capacity_bytes=1 << 20)
    both, other = _set("a", "b"), _set("b", "c")
    for documents, chunk_id in ((both, "a"), (both, "b"), (other, "b"), (other, "c")):
        variants.keep(documents, _match(chunk_id), _rows(10))
    variants.forget(["a"])
    assert variants.get(both, _match("b")) is None  # computed beside "a": gone with it
    assert variants.get(other, _match("b")) is not None
    assert variants.stats()["variants"] == 2 and variants.stats()["document_sets"] == 1
    assert variants.bytes_used == 2 * _rows(10).nbytes
