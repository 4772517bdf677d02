"""A prompt matched to registered chunks: text and chunk segments, the chunks pinned.

The chunk index finds every registered chunk inside the prompt's tokens, at any position; each
match is pinned in the tiered store (so it cannot be evicted while the request uses it) and
becomes a chunk segment of the rows it covers, and the tokens between matches become text. A
placement probe pins the probe's own copies of the chunks instead (`placement_control.py`);
a request's plan unpins them when it is done with them (`plan.py`).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import NamedTuple

from sglang_hicache_ext.fusion.request import ChunkSegment, Segment, TextSegment, slice_chunk
from sglang_hicache_ext.sglang_ext.chunk_fusion.context_variants import document_set
from sglang_hicache_ext.sglang_ext.chunk_fusion.registration import prefix_id
from sglang_hicache_ext.sglang_ext.chunk_fusion.registry import ChunkRegistry
from sglang_hicache_ext.tiers.chunks.chunk_tiers import HOST


class PinnedSegments(NamedTuple):
    segments: list[Segment]
    pinned: list[str]  # chunk ids held for the request (callers unpin)
    tiers: dict[str, int]  # how many chunks each tier served
    tokens_by_tier: dict[str, int]  # how many chunk tokens each tier served
    fetched: WholeFetches  # chunks read whole from a lower tier while pinning
    # Chunks read as a shadow check computed them among these documents (context_variants.py).
    in_context: frozenset[str] = frozenset()


class WholeFetches(NamedTuple):
    """Chunks a lower tier returned whole when pinned (not streamed): their bytes and the time
    the pins took, all of it before the compute (nothing of it is overlapped)."""

    nbytes: int = 0
    seconds: float = 0.0


def pinned_chunk_segments(
    registry: ChunkRegistry, tokens: list[int], probe_form: str | None = None
) -> PinnedSegments:
    """The prompt as text and chunk segments, with the matched chunks pinned (callers unpin);
    with `probe_form`, each chunk's registered rows through that form's codec (a placement
    probe).

    A chunk evicted or deleted since matching is skipped: its tokens are computed like text."""
    segments: list[Segment] = []
    pinned: list[str] = []
    tiers: Counter[str] = Counter()
    tokens_by_tier: Counter[str] = Counter()
    cursor = 0
    fetched = WholeFetches()
    metrics = registry.metrics if probe_form is None else None  # probes are not traffic
    matches = registry.find(tokens)
    # A probe measures the stored rows through a codec: never a variant.
    variants = registry.context_variants if probe_form is None else None
    documents = document_set(matches)
    in_context: set[str] = set()
    for match in matches:
        began = time.perf_counter()
        chunk_id = match.chunk_id
        held = (
            registry.pin(chunk_id)
            if probe_form is None
            else registry.pin_form(chunk_id, probe_form)
        )
        if held is not None and held.tier != HOST and not held.streamed:  # fetched whole
            fetched = WholeFetches(
                fetched.nbytes + held.chunk.nbytes,
                fetched.seconds + time.perf_counter() - began,
            )
        if held is None:
            if metrics is not None:
                metrics.chunk_miss()
            continue
        chunk = held.chunk
        pinned.append(match.chunk_id)
        tiers[held.tier] += 1
        tokens_by_tier[held.tier] += match.chunk_end - match.chunk_start
        if match.prompt_start > cursor:
            segments.append(TextSegment(tuple(tokens[cursor : match.prompt_start])))
        span = slice_chunk(chunk, match.chunk_start, match.chunk_end)
        # The stored chunk stays pinned (its tier served the request, its reads are counted);
        # the rows read are a shadow check's when it computed them among these documents.
        variant = None if variants is None else variants.get(documents, match)
        if variant is not None:
            span = variant
            in_context.add(chunk_id)
        if metrics is not None:
            metrics.chunk_hit(span.nbytes, tier=held.tier)
        segments.append(ChunkSegment(span))
        cursor = match.prompt_end
    if cursor < len(tokens):
        segments.append(TextSegment(tuple(tokens[cursor:])))
    return PinnedSegments(
        segments, pinned, dict(tiers), dict(tokens_by_tier), fetched, frozenset(in_context)
    )


def pin_request_chunks(
    registry: ChunkRegistry, tokens: list[int], probe_form: str | None
) -> PinnedSegments:
    """A fused request's chunks pinned (`pinned_chunk_segments`, callers `unpin_chunks`). A
    real request's (not a probe's) chunks and the question after the last of them are what
    the placement learns its reads from."""
    held = pinned_chunk_segments(registry, tokens, probe_form)
    if held.pinned and probe_form is None:
        registry.placement.usage.record(held.pinned, tokens[last_chunk_end(held.segments) :])
    return held


def unpin_chunks(registry: ChunkRegistry, chunk_ids: list[str], probe_form: str | None) -> None:
    """Let go of the chunks `pin_request_chunks` pinned with the same `probe_form`."""
    for chunk_id in chunk_ids:
        registry.unpin(chunk_id, probe=probe_form is not None)


def chunk_positions(segments: list[Segment]) -> list[tuple[int, int]]:
    """Prompt positions [start, end) of each chunk occurrence, in order."""
    spans: list[tuple[int, int]] = []
    position = 0
    for segment in segments:
        if isinstance(segment, ChunkSegment):
            spans.append((position, position + segment.chunk.num_tokens))
            position += segment.chunk.num_tokens
        else:
            position += len(segment.token_ids)
    return spans


def last_chunk_end(segments: list[Segment]) -> int:
    """Prompt position just after the last chunk token (0: no chunk)."""
    spans = chunk_positions(segments)
    return spans[-1][1] if spans else 0


def prefix_agreement(
    registry: ChunkRegistry,
    chunk_ids: list[str],
    tokens: list[int],
    in_context: frozenset[str] = frozenset(),
) -> dict[str, int]:
    """How many of a prompt's chunks were computed after the prefix the prompt starts with
    ("same"), after another one ("other"), alone ("alone"), with none recorded ("unknown"), or
    read as a shadow check computed them in a prompt of these documents (`in_context`: after
    that prompt's start and the other documents). A chunk computed after another prefix is
    still used; the response says so."""
    counts = dict.fromkeys(("same", "other", "alone", "unknown", "in_context"), 0)
    starts: dict[int, str] = {}  # the prompt's own prefix id per length, hashed once
    for chunk_id in chunk_ids:
        prefix = registry.prefix_of(chunk_id)
        if chunk_id in in_context:
            counts["in_context"] += 1
        elif prefix is None:
            counts["unknown"] += 1
        elif not prefix[0]:
            counts["alone"] += 1
        else:
            if prefix[1] not in starts:
                starts[prefix[1]] = prefix_id(tokens[: prefix[1]])
            same = prefix[1] <= len(tokens) and starts[prefix[1]] == prefix[0]
            counts["same" if same else "other"] += 1
    return counts
