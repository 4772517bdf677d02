"""A fusion request: an ordered list of segments, laid out at global positions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang_hicache_ext.fusion.chunk import StoredChunk


@dataclass(frozen=True)
class TextSegment:
    """Tokens always computed. `question=True` marks the query tokens a3 scores chunks with."""

    token_ids: tuple[int, ...]
    question: bool = False


@dataclass(frozen=True)
class ChunkSegment:
    """One occurrence of a precomputed chunk; its tokens reuse the stored KV unless selected."""

    chunk: StoredChunk


Segment = TextSegment | ChunkSegment


@dataclass(frozen=True)
class ChunkSpan:
    """Where chunk occurrence `index` sits in the request: positions [start, start + length)."""

    index: int
    start: int
    length: int
    chunk: StoredChunk


@dataclass(frozen=True, eq=False)
class RequestLayout:
    """Token ids and masks of the whole request at positions 0..N-1."""

    token_ids: torch.Tensor
    is_chunk: torch.Tensor
    is_question: torch.Tensor
    spans: tuple[ChunkSpan, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_chunk_tokens(self) -> int:
        return sum(span.length for span in self.spans)

    @property
    def chunk_positions(self) -> torch.Tensor:
        """Global positions of all chunk tokens, in request order."""
        return torch.nonzero(self.is_chunk, as_tuple=False).flatten()


def slice_chunk(chunk: StoredChunk, start: int, end: int) -> StoredChunk:
    """Rows [start, end) of a chunk (no rows read; the chunk itself when whole)."""
    return chunk.slice(start, end)


def after_exact_prefix(segments: Sequence[Segment], prefix_len: int) -> list[Segment]:
    """The same tokens, with everything before `prefix_len` as plain text.

    Positions below `prefix_len` hold exact cached KV, so they are neither chunk tokens to select
    nor tokens to compute; a chunk the prefix covers in part keeps only its rows after it.
    """
    out: list[Segment] = []
    position = 0
    for segment in segments:
        if isinstance(segment, TextSegment):
            out.append(segment)
            position += len(segment.token_ids)
            continue
        chunk = segment.chunk
        start, position = position, position + chunk.num_tokens
        if start >= prefix_len:
            out.append(segment)
        elif position <= prefix_len:
            out.append(TextSegment(chunk.token_ids))
        else:
            cut = prefix_len - start
            out.append(TextSegment(chunk.token_ids[:cut]))
            out.append(ChunkSegment(slice_chunk(chunk, cut, chunk.num_tokens)))
    return out


# A scoring pass keeps the prompt's first tokens: the attention sink a question reads (StreamingLLM
# keeps four), where a stored chunk's own first tokens would take its place.
_ATTENTION_SINK = 4


# How many of the question's last tokens a scoring pass reads by default. A prompt without an
# explicit question takes all the text after its last chunk as one, and that text is often more
# context (new paragraphs) before the question: read whole, a prompt whose last paragraphs were
# new spent most of its fused prefill in the scoring pass (docs/fusion-quality.md).
SCORING_QUESTION_TOKENS = 96

# The most a scoring pass's read of the question may cost, as a share of the compute the
# request's reuse saves: a prompt that reuses one short paragraph saves little, and a full read
# cost more than it saved (docs/auto-chunks.md, "When fusion does not pay").
SCORING_COST_SHARE = 0.1
# ... but never fewer than this many (when the question has them): the end of a prompt is the
# chat template's few tokens and the question's last words, and a read of a dozen tokens lost
# the answer's first token where 96 kept it (docs/fusion-quality.md).
SCORING_MIN_QUESTION_TOKENS = 32
# What a row costs a scoring pass against a row of the prefill, per layer: the pass computes a
# few dozen rows, whose projections run below the matrix units' rate and whose per-layer fixed
# costs (norms, RoPE, recording) are shared by few rows. CPU server, SmolLM2: 32 rows through 23
# layers in 145-203 ms, 200-280 us a row-layer against the prefill's 62-86 (docs/auto-chunks.md,
# "What the benchmark resolves, and the fused requests at low shares"); the low end is kept.
SCORING_PASS_ROW_COST = 2.5


def question_over_chunks(
    layout: RequestLayout, prefix_len: int, question_tokens: int | None = SCORING_QUESTION_TOKENS
) -> list[Segment] | None:
    """What a scoring pass reads of a request: its chunks in order, the last `question_tokens`
    of its question (None: all of it), its exact prefix and its first tokens (the prompt's
    attention sink), as segments; the other text, which the prefill computes anyway, is left
    out. None when nothing would be. The chunk tokens are the request's, in the same order, so
    the question's attention to them scores the request's own chunk tokens one for one."""
    question_at = torch.nonzero(layout.is_question).flatten()
    if question_tokens is not None:
        question_at = question_at[-question_tokens:]  # >= 1: the selector checks it
    keep = layout.is_chunk.clone()
    keep[question_at] = True
    keep[: max(prefix_len, _ATTENTION_SINK)] = True
    if bool(keep.all()):
        return None
    # Python lists: a tensor indexed element by element costs microseconds a token.
    ids, question, kept_at = layout.token_ids.tolist(), layout.is_question.tolist(), keep.tolist()
    out: list[Segment] = []

    def text(start: int, end: int) -> None:
        kept = [p for p in range(start, end) if kept_at[p]]
        run: list[int] = []  # consecutive kept positions of one kind: question or not
        for position in kept:
            if run and question[run[-1]] != question[position]:
                out.append(TextSegment(tuple(ids[p] for p in run), question[run[-1]]))
                run = []
            run.append(position)
        if run:
            out.append(TextSegment(tuple(ids[p] for p in run), question[run[-1]]))

    position = 0
    for span in layout.spans:
        text(position, span.start)
        out.append(ChunkSegment(span.chunk))
        position = span.start + span.length
    text(position, layout.num_tokens)
    return out


def build_layout(segments: list[Segment] | tuple[Segment, ...]) -> RequestLayout:
    """Lay segments end to end. Without an explicit question, the question-aware selectors use
    the text after the last chunk (the last token when there is none)."""
    if not segments:
        raise ValueError("a request needs at least one segment")
    ids: list[int] = []
    chunk_flags: list[bool] = []
    question_flags: list[bool] = []
    spans: list[ChunkSpan] = []
    for segment in segments:
        if isinstance(segment, ChunkSegment):
            length = segment.chunk.num_tokens
            spans.append(ChunkSpan(len(spans), len(ids), length, segment.chunk))
            ids.extend(segment.chunk.token_ids)
            chunk_flags.extend([True] * length)
            question_flags.extend([False] * length)
        elif isinstance(segment, TextSegment):
            ids.extend(segment.token_ids)
            chunk_flags.extend([False] * len(segment.token_ids))
            question_flags.extend([segment.question] * len(segment.token_ids))
        else:
            raise ValueError(f"unknown segment type {type(segment).__name__}")
    if not ids:
        raise ValueError("a request needs at least one token")
    is_chunk = torch.tensor(chunk_flags, dtype=torch.bool)
    is_question = torch.tensor(question_flags, dtype=torch.bool)
    if not bool(is_question.any()) and spans:
        # The tokens that read the chunks: the text after the last chunk, or, when the prompt
        # ends inside a chunk, its last token (always computed, for the next-token logits).
        tail_start = spans[-1].start + spans[-1].length
        is_question[min(tail_start, len(ids) - 1) :] = True
    return RequestLayout(
        token_ids=torch.tensor(ids, dtype=torch.long),
        is_chunk=is_chunk,
        is_question=is_question,
        spans=tuple(spans),
    )
