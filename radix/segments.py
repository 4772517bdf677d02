"""Where a prompt's reusable pieces (documents) begin and end, from its token ids alone.

Reuse from ordinary traffic needs pieces that come out the same wherever a document sits in a
prompt, with no registration and no separator string. Two rules give that:

- **Paragraphs.** A cut at every break token (a token whose text holds a line break, and every
  special token of the chat template). Byte-level BPE tokenizers start a fresh pre-token after a
  line break, so a paragraph's tokens do not depend on what came before it; what a client puts
  around a document (`Document 3. `, `[3]`) differs from prompt to prompt only in a few tokens,
  which the chunk index's matching leaves out (`radix/chunk_index.py` extends a match only as
  far as the tokens agree).
- **Content-defined cuts inside long paragraphs.** A paragraph longer than `max_tokens` is cut
  where a hash of the last `window` tokens hits a fixed residue (as rsync and LMCache's rolling
  hash do), so a long document is cut at the same places in every prompt.

Paragraphs shorter than `min_tokens` (questions, labels, instructions) are not pieces.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

_HASH_BASE = np.uint64(0x100000001B3)  # FNV-64's prime: an odd multiplier mixing every id


@dataclass(frozen=True)
class SegmentRule:
    """How a prompt is cut into pieces worth storing."""

    min_tokens: int = 32
    max_tokens: int = 512
    # Inside a paragraph longer than max_tokens: a cut on average every `cut_every` tokens.
    cut_every: int = 256
    window: int = 8

    def __post_init__(self) -> None:
        if self.min_tokens < 8:
            raise ValueError(
                f"min_tokens must be >= 8 (the chunk index's anchor), got {self.min_tokens}"
            )
        if self.max_tokens < 2 * self.min_tokens:
            raise ValueError(
                f"max_tokens ({self.max_tokens}) must be at least twice min_tokens ({self.min_tokens})"
            )
        if not 0 < self.cut_every <= self.max_tokens:
            raise ValueError(f"cut_every must be in 1..max_tokens, got {self.cut_every}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")


def document_segments(
    token_ids: Sequence[int], breaks: Collection[int], rule: SegmentRule = SegmentRule()
) -> list[tuple[int, int]]:
    """[start, end) spans of the pieces of a prompt, in prompt order."""
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.size == 0:
        return []
    is_break = np.isin(ids, np.fromiter(breaks, dtype=np.int64, count=len(breaks)))
    # Paragraphs: maximal runs of non-break tokens.
    edges = np.flatnonzero(np.diff(np.concatenate(([True], is_break, [True])).astype(np.int8)))
    spans: list[tuple[int, int]] = []
    for start, end in zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True):
        if end - start < rule.min_tokens:
            continue
        if end - start <= rule.max_tokens:
            spans.append((start, end))
        else:
            spans.extend(_content_cuts(ids, start, end, rule))
    return spans


# A piece's sights are counted by its last tokens: a label a client puts before a document
# ("Document 3. ", "[12]") is among its first tokens, which the key leaves out.
SIGHT_KEY_TOKENS = 24
LABEL_TOKENS = 8


def sight_key(token_ids: Sequence[int]) -> str:
    """What makes two sights of a piece the same content, for counting how often it is seen:
    a hash of its last `SIGHT_KEY_TOKENS` tokens, never of its first `LABEL_TOKENS` (a
    shorter piece: all of it after them). The same paragraph under any label, at any
    position, is one key, where the piece's own id (the hash of all its tokens) is one per
    label; two pieces that end alike are one key too, which only overestimates their counts,
    as a frequency sketch's collisions do."""
    n = len(token_ids)
    start = max(n - SIGHT_KEY_TOKENS, min(LABEL_TOKENS, n - 1), 0)
    tail = np.asarray(token_ids[start:], dtype="<u4").tobytes()
    return "sight:" + hashlib.blake2b(tail, digest_size=16).hexdigest()


def _content_cuts(
    ids: np.ndarray, start: int, end: int, rule: SegmentRule
) -> list[tuple[int, int]]:
    """A long paragraph cut where the hash of the last `window` tokens is 0 mod `cut_every`,
    no piece shorter than min_tokens nor longer than max_tokens."""
    hashes = _window_hashes(ids[start:end].astype(np.uint64), rule.window)
    hits = (hashes % np.uint64(rule.cut_every)) == 0
    pieces: list[tuple[int, int]] = []
    piece_start = start
    for offset in range(end - start):
        position = start + offset + 1  # a cut after this token
        length = position - piece_start
        if length >= rule.max_tokens or (length >= rule.min_tokens and hits[offset]):
            pieces.append((piece_start, position))
            piece_start = position
    if piece_start < end:
        if end - piece_start >= rule.min_tokens or not pieces:
            pieces.append((piece_start, end))
        else:  # a short tail joins the piece before it (at most max + min tokens)
            pieces[-1] = (pieces[-1][0], end)
    return pieces


def _window_hashes(ids: np.ndarray, window: int) -> np.ndarray:
    """Polynomial hash of the `window` tokens ending at each position (fewer at the start);
    uint64 arithmetic wraps, which is the modulus."""
    hashes = np.zeros(ids.shape, dtype=np.uint64)
    power = np.uint64(1)
    with np.errstate(over="ignore"):
        for lag in range(window):
            shifted = np.zeros_like(ids)
            shifted[lag:] = ids[: ids.size - lag] + np.uint64(1)
            hashes += shifted * power
            power = power * _HASH_BASE
        # Mix the high bits down: the residue mod a small number reads the low bits.
        hashes ^= hashes >> np.uint64(29)
        hashes *= np.uint64(0xBF58476D1CE4E5B9)
        hashes ^= hashes >> np.uint64(32)
    return hashes


def break_token_ids(tokenizer: Any) -> frozenset[int]:
    """The tokenizer's break tokens: every token whose text holds a line break, and every
    special or added token (chat template markers). `tokenizer` is a Hugging Face tokenizer
    (duck-typed: `batch_decode`, `all_special_ids`, `added_tokens_decoder`)."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    breaks = {i for i, text in enumerate(texts) if "\n" in text or "\r" in text}
    breaks.update(int(i) for i in tokenizer.all_special_ids)
    breaks.update(int(i) for i in getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return frozenset(breaks)
