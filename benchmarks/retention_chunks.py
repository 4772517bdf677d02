"""The chunks the retention harness (`benchmarks/fusion_retention.py`) fuses a question's prompt
with, and where their KV comes from: each paragraph prefilled alone or after the prompt's system
prompt and chat header (`fusion/precompute.py`), or the pieces an `auto_chunks` server keeps from
earlier prompts (`radix/segments.py`) with those prompts' own rows; optionally passed through a
tier's codec. Every set is matched to the prompt the way the server matches chunks.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.fusion_quality import chat_prefix, chatml_prompt
from sglang_hicache_ext.evaluation.hotpotqa import HotpotQAExample
from sglang_hicache_ext.fusion import precompute_chunk
from sglang_hicache_ext.fusion.adapter import ModelAdapter
from sglang_hicache_ext.fusion.chunk import PrecomputedChunk
from sglang_hicache_ext.fusion.frequency import frequency_scores
from sglang_hicache_ext.fusion.request import Segment
from sglang_hicache_ext.radix.segments import break_token_ids, document_segments
from sglang_hicache_ext.sglang_ext.chunk_fusion.chunk_matches import pinned_chunk_segments
from sglang_hicache_ext.sglang_ext.chunk_fusion.registry import ChunkRegistry
from sglang_hicache_ext.tiers.chunks.stored_forms import stored_codec
from sglang_hicache_ext.tiers.chunks.stored_forms import through_codec as stored_through_codec


def question_segments(
    example: HotpotQAExample,
    tokenizer: Any,
    adapter: ModelAdapter,
    codec: str | None = None,
    prefix_chunks: bool = False,
    traffic_question: str | None = None,
    traffic_others: Sequence[str] = (),
    new_share: float = 0.0,
) -> list[Segment]:
    """The prompt with every paragraph shuffled in, each matched to its precomputed chunk the way
    the server matches them (the whole prompt tokenized, chunks found by the chunk index); with
    `codec`, every chunk's K/V went through it (compressed and decompressed) first; with
    `prefix_chunks`, every chunk was precomputed after the prompt's system prompt and chat header
    (`chat_prefix`) instead of alone; with `traffic_question`, the chunks are the pieces an
    `auto_chunks` server captures from another prompt (the paragraphs in another order, that
    question), with that prompt's own rows or, with `prefix_chunks`, precomputed after the prefix;
    with `new_share`, that share of the paragraphs (drawn per question) is not stored: new text."""
    paragraphs = list(example.documents)
    shuffled = random.Random(example.qid).sample(paragraphs, len(paragraphs))
    ids = tokenizer.encode(chatml_prompt(shuffled, example.question), add_special_tokens=False)
    prefix = tokenizer.encode(chat_prefix(), add_special_tokens=False) if prefix_chunks else []
    registry = ChunkRegistry(2**34, adapter.rope_specs())
    if traffic_question is not None:
        chunks = traffic_chunks(
            example, tokenizer, adapter, traffic_question, prefix, traffic_others
        )
        for chunk in chunks:
            registry.add(chunk if codec is None else through_codec(chunk, codec))
        return pinned_chunk_segments(registry, ids)[0]
    new = set(
        random.Random(f"{example.qid}/new").sample(paragraphs, round(new_share * len(paragraphs)))
    )
    for paragraph in paragraphs:
        if paragraph in new:
            continue
        tokens = tokenizer.encode(paragraph, add_special_tokens=False)
        chunk = precompute_chunk(adapter, tokens, prefix_ids=prefix)
        registry.add(chunk if codec is None else through_codec(chunk, codec))
    return pinned_chunk_segments(registry, ids)[0]


def traffic_chunks(
    example: HotpotQAExample,
    tokenizer: Any,
    adapter: ModelAdapter,
    question: str,
    prefix: list[int],
    others: Sequence[str] = (),
) -> list[PrecomputedChunk]:
    """The chunks an `auto_chunks` server captures from first prompts with the example's
    paragraphs in another order and another question: their pieces, with the rows those
    prompts' prefills computed (pre-RoPE), or precomputed after `prefix` when one is given.
    With `others`, two first prompts, each with half the paragraphs among as many of `others`."""
    paragraphs = list(example.documents)
    draw = random.Random(f"{example.qid}/traffic")
    order = draw.sample(paragraphs, len(paragraphs))
    if not others:
        return _prompt_pieces(order, question, tokenizer, adapter, prefix)
    chunks = []
    for half in (order[0::2], order[1::2]):
        mixed = half + draw.sample(list(others), min(len(half), len(others)))
        chunks += _prompt_pieces(
            draw.sample(mixed, len(mixed)), question, tokenizer, adapter, prefix
        )
    return chunks


def _prompt_pieces(
    documents: list[str], question: str, tokenizer: Any, adapter: ModelAdapter, prefix: list[int]
) -> list[PrecomputedChunk]:
    ids = tokenizer.encode(chatml_prompt(documents, question), add_special_tokens=False)
    pieces = document_segments(ids, _breaks(tokenizer))
    if prefix:
        return [precompute_chunk(adapter, ids[s:e], prefix_ids=prefix) for s, e in pieces]
    whole = precompute_chunk(adapter, ids)
    chunks = []
    for start, end in pieces:
        keys = tuple(k[start:end].contiguous() for k in whole.keys)
        values = tuple(v[start:end].contiguous() for v in whole.values)
        scores = torch.stack(
            [frequency_scores(k, v, whole.alpha) for k, v in zip(keys, values, strict=True)]
        )
        chunks.append(PrecomputedChunk(tuple(ids[start:end]), keys, values, scores, whole.alpha))
    return chunks


# The tokenizer's break tokens, found once per tokenizer (a decode of the whole vocabulary).
_breaks = functools.lru_cache(maxsize=2)(break_token_ids)


def through_codec(chunk: PrecomputedChunk, spec: str) -> PrecomputedChunk:
    """The chunk as a tier storing it with codec `spec` returns it (int8 / int4: the codecs
    tiers store, `tiers/chunks/stored_forms.py`)."""
    try:
        return PrecomputedChunk(*stored_through_codec(chunk, stored_codec(spec)))
    except ValueError as err:
        raise SystemExit(str(err)) from None
