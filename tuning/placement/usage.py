"""What real requests did with each chunk, for the placement: how often they read it (an
exponentially decayed count, so that popularity can change) and the last questions asked
with it (the profiler's probes come from real queries first, templates only without them).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence
from typing import NamedTuple

DEFAULT_QUESTIONS_KEPT = 2
DEFAULT_QUESTION_TOKENS = 96  # the end of the text after a chunk: the question, not more context
DECAY = 0.5  # each placement round keeps half of the earlier rounds' counts


class ChunkUse(NamedTuple):
    frequency: float  # reads in this round plus DECAY times the earlier rounds' frequency
    questions: tuple[tuple[int, ...], ...]  # token ids, the most recent last


class ChunkUsage:
    """Thread-safe: the scheduler records, the placement round reads and decays."""

    def __init__(
        self,
        questions_kept: int = DEFAULT_QUESTIONS_KEPT,
        question_tokens: int = DEFAULT_QUESTION_TOKENS,
    ) -> None:
        self._questions_kept = questions_kept
        self._question_tokens = question_tokens
        self._earlier: dict[str, float] = {}
        self._reads: dict[str, int] = {}
        self._questions: dict[str, deque[tuple[int, ...]]] = {}
        self._lock = threading.Lock()

    def record(self, chunk_ids: Iterable[str], question: Sequence[int]) -> None:
        """One request read `chunk_ids`; `question` is the prompt's text after its last chunk."""
        asked = tuple(question[-self._question_tokens :])
        with self._lock:
            for chunk_id in dict.fromkeys(chunk_ids):
                self._reads[chunk_id] = self._reads.get(chunk_id, 0) + 1
                if asked:
                    kept = self._questions.setdefault(chunk_id, deque(maxlen=self._questions_kept))
                    if asked not in kept:
                        kept.append(asked)

    def use(self, chunk_id: str) -> ChunkUse:
        with self._lock:
            return self._use(chunk_id)

    def _use(self, chunk_id: str) -> ChunkUse:
        frequency = self._reads.get(chunk_id, 0) + DECAY * self._earlier.get(chunk_id, 0.0)
        return ChunkUse(frequency, tuple(self._questions.get(chunk_id, ())))

    def reads(self) -> dict[str, int]:
        """The reads of the round so far (a snapshot a placement plans with)."""
        with self._lock:
            return dict(self._reads)

    def end_round(
        self, chunk_ids: Iterable[str], reads: dict[str, int] | None = None
    ) -> dict[str, ChunkUse]:
        """Every chunk's use up to now; the round's reads (those of the snapshot `reads`, when
        given: later ones stay in the next round) then become the decayed history."""
        with self._lock:
            uses = {chunk_id: self._use(chunk_id) for chunk_id in chunk_ids}
            counted = dict(self._reads) if reads is None else reads
            earlier = {}
            for key in uses:
                frequency = counted.get(key, 0) + DECAY * self._earlier.get(key, 0.0)
                if frequency > 0:
                    earlier[key] = frequency
            self._earlier = earlier
            left = {key: n - counted.get(key, 0) for key, n in self._reads.items()}
            self._reads = {key: n for key, n in left.items() if n > 0}
            return uses

    def forget(self, chunk_ids: Iterable[str]) -> None:
        with self._lock:
            for chunk_id in chunk_ids:
                self._earlier.pop(chunk_id, None)
                self._reads.pop(chunk_id, None)
                self._questions.pop(chunk_id, None)
