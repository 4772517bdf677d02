"""Find registered chunks inside a prompt's token ids, at any offset, in any order.

A chunk is tokenized alone when registered, but inside a prompt its first and last tokens may be
tokenized differently (a space or newline merges with the neighbouring text). So matching does
not require the whole chunk: a short interior window (an anchor k-gram) locates a candidate
alignment, which is then extended token by token in both directions as far as prompt and chunk
agree. The agreeing span is the match; the differing edge tokens are simply not covered, and the
caller computes them like any other prompt token.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_ANCHOR_TOKENS = 8
# An anchor that occurs in more chunks than this is common text (boilerplate), not an identity.
MAX_ANCHOR_OCCURRENCES = 8


@dataclass(frozen=True)
class ChunkMatch:
    """Prompt tokens [prompt_start, prompt_start + length) equal chunk tokens [chunk_start, ...)."""

    chunk_id: str
    prompt_start: int
    chunk_start: int
    length: int

    @property
    def prompt_end(self) -> int:
        return self.prompt_start + self.length

    @property
    def chunk_end(self) -> int:
        return self.chunk_start + self.length


class ChunkIndex:
    """Token-level index of registered chunks.

    `min_coverage` is the fraction of a chunk that a match must cover to count (short accidental
    overlaps between unrelated texts are not reuse).
    """

    def __init__(
        self, anchor_tokens: int = DEFAULT_ANCHOR_TOKENS, min_coverage: float = 0.5
    ) -> None:
        if anchor_tokens < 2:
            raise ValueError(f"anchor_tokens must be >= 2, got {anchor_tokens}")
        if not 0.0 < min_coverage <= 1.0:
            raise ValueError(f"min_coverage must be in (0, 1], got {min_coverage}")
        self._k = anchor_tokens
        self._min_coverage = min_coverage
        self._chunks: dict[str, tuple[int, ...]] = {}
        self._anchors: defaultdict[tuple[int, ...], list[tuple[str, int]]] = defaultdict(list)

    def __len__(self) -> int:
        return len(self._chunks)

    @property
    def anchor_tokens(self) -> int:
        """The shortest chunk the index can match."""
        return self._k

    def __contains__(self, chunk_id: object) -> bool:
        return chunk_id in self._chunks

    def tokens(self, chunk_id: str) -> tuple[int, ...]:
        return self._chunks[chunk_id]

    def add(self, chunk_id: str, token_ids: Sequence[int]) -> None:
        """Register a chunk; re-adding the same id with the same tokens is a no-op."""
        tokens = tuple(int(t) for t in token_ids)
        if len(tokens) < self._k:
            raise ValueError(
                f"chunk {chunk_id!r} has {len(tokens)} tokens; at least {self._k} are needed to match it"
            )
        existing = self._chunks.get(chunk_id)
        if existing is not None:
            if existing != tokens:
                raise ValueError(f"chunk id {chunk_id!r} is already registered with other tokens")
            return
        self._chunks[chunk_id] = tokens
        for offset in range(len(tokens) - self._k + 1):
            self._anchors[tokens[offset : offset + self._k]].append((chunk_id, offset))

    def remove(self, chunk_id: str) -> None:
        tokens = self._chunks.pop(chunk_id)  # KeyError names an unknown id
        for offset in range(len(tokens) - self._k + 1):
            anchor = tokens[offset : offset + self._k]
            entries = [e for e in self._anchors[anchor] if e[0] != chunk_id]
            if entries:
                self._anchors[anchor] = entries
            else:
                del self._anchors[anchor]

    def find(self, prompt: Sequence[int]) -> list[ChunkMatch]:
        """Non-overlapping matches in prompt order; each chunk occurrence at most once."""
        tokens = tuple(int(t) for t in prompt)
        matches: list[ChunkMatch] = []
        position = 0
        while position + self._k <= len(tokens):
            floor = matches[-1].prompt_end if matches else 0
            best = self._best_match_at(tokens, position, floor)
            if best is None:
                position += 1
                continue
            matches.append(best)
            position = best.prompt_end
        return matches

    def _best_match_at(
        self, prompt: tuple[int, ...], position: int, floor: int
    ) -> ChunkMatch | None:
        candidates = self._anchors.get(prompt[position : position + self._k])
        if not candidates or len(candidates) > MAX_ANCHOR_OCCURRENCES:
            return None
        best: ChunkMatch | None = None
        for chunk_id, offset in candidates:
            match = self._extend(prompt, position, floor, chunk_id, offset)
            chunk_len = len(self._chunks[chunk_id])
            if match.length < self._min_coverage * chunk_len:
                continue
            if best is None or match.length > best.length:
                best = match
        return best

    def _extend(
        self, prompt: tuple[int, ...], position: int, floor: int, chunk_id: str, offset: int
    ) -> ChunkMatch:
        """Grow the anchor both ways while chunk and prompt agree, never below `floor`.

        Growing left matters when earlier windows were skipped (too common, or a candidate that
        covered too little), not only at the chunk's first token."""
        chunk = self._chunks[chunk_id]
        back = 0
        while (
            offset - back - 1 >= 0
            and position - back - 1 >= floor
            and chunk[offset - back - 1] == prompt[position - back - 1]
        ):
            back += 1
        forward = self._k
        while (
            offset + forward < len(chunk)
            and position + forward < len(prompt)
            and chunk[offset + forward] == prompt[position + forward]
        ):
            forward += 1
        return ChunkMatch(
            chunk_id=chunk_id,
            prompt_start=position - back,
            chunk_start=offset - back,
            length=back + forward,
        )
