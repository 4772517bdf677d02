"""Which chunk host memory gives up first when a new one needs room: by utility, not recency.

EvicPress's utility (Util = (alpha * quality - TTFT) * frequency, §4.2; `tuning/placement`
plans it in rounds) applied to one chunk at a time, on the insert that needs the room. Keeping
a chunk in a form is worth its expected reuse rate f (`frequency`: decayed reads and puts, and
the admission sketch's sights where there is one) times the prefill seconds a reuse saves from
that form, for a chunk of T tokens at p prefill seconds a token:

    host memory, form F:   (1 - error_F) * T * p - decode_F      (error: relative KV error)
    a lower tier only:     T * p - stored bytes / the tier's read rate
    no tier:               0 (the request computes it)

While the insert does not fit, the move that loses the least worth per byte it frees goes
first: compressing a chunk one step (dense -> int8 -> int4) while its KV error stays within
`max_error`, or dropping it from host memory (a demotion when a lower tier keeps it, a loss
otherwise). Ties go to the least recently used (host memory lists entries that way). So a
popular chunk is compressed before a one-off is dropped only when that costs less, and a
one-off held on disk is demoted before a popular chunk is lost.

A compression is checked when it is made: the rows it decodes to are compared with the rows it
replaces (`ChunkForms.compress`), errors add up along the steps (a bound on the error against
the rows first stored), and one past `max_error` is not kept (counted as
`compression_refused`, never tried again for that chunk). The sizes, errors and decode times of
each step are learned from the compressions made (moving averages from the priors below), so
the planner stops proposing a step the model's KV does not take well.

Nothing here imports SGLang or fusion: the owner of host memory says what a stored value is
(`ChunkForms`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, Protocol, TypeVar

import cachetools

from sglang_hicache_ext.tiers.chunks.admission import FrequencyAdmission
from sglang_hicache_ext.tiers.chunks.header import CorruptChunkError

logger = logging.getLogger(__name__)

DENSE = "none"
# The next, smaller form of each form host memory may hold (the codec that makes it).
NEXT_FORM = {DENSE: "int8", "int8": "int4"}
# Priors until compressions are measured: stored bytes of a step over its source's (int8 of
# bf16 rows 0.53, of fp32 0.27; int4 of int8 about 0.55), the relative KV error a step adds
# (benchmarks/results/codec_errors_smollm2.json: int8 at most 0.2 %, int4 2.8-3.3 %) and the
# decode seconds per stored byte (the same file: 0.4 and 0.7 ms per dense MB).
PRIOR_SIZE_RATIO = {"int8": 0.53, "int4": 0.55}
PRIOR_STEP_ERROR = {"int8": 0.002, "int4": 0.03}
PRIOR_DECODE_S_PER_BYTE = {DENSE: 0.0, "int8": 1.5e-9, "int4": 5e-9}
# A CPU's prefill, SmolLM2-135M on 2 cores, about 1 ms a token, until the server has measured
# its own (`RetentionCosts.measured_prefill`); the order of moves depends on it only where a
# decode or a disk read costs as much as the prefill it saves.
PRIOR_PREFILL_S_PER_TOKEN = 1e-3
PRIOR_LOWER_BYTES_PER_S = 1e9  # a local SSD's read rate
LEARNING_RATE = 0.2  # weight of each new measurement in the moving averages


V = TypeVar("V")


class ChunkForms(Protocol[V]):
    """What the owner of host memory says of a stored value."""

    def form(self, value: V) -> str:
        """ "none" (dense rows) or the codec that compressed it."""
        ...

    def tokens(self, value: V) -> int: ...

    def nbytes(self, value: V) -> int: ...

    def below(self, key: str) -> bool:
        """Whether a lower tier keeps `key` (dropping it from host memory loses nothing). Called
        with host memory's lock held: must not ask host memory."""
        ...

    def compress(self, key: str, value: V, to: str) -> tuple[V, float]:
        """`value` compressed to form `to`, and the relative error of the rows it decodes to
        against `value`'s rows (the largest over layers of |K' - K| / |K| and |V' - V| / |V|)."""
        ...


class Held(NamedTuple):
    """A chunk host memory holds and may give up (not pinned)."""

    key: str
    nbytes: int
    tokens: int
    form: str
    below: bool


class Move(NamedTuple):
    key: str
    to: str | None  # the form it is compressed to; None: dropped from host memory
    freed: int  # bytes it frees (estimated for a compression)
    cost: float  # the worth it loses per byte freed


@dataclass
class UseCounts:
    """Decayed uses per key: one per store and per read, every count halved after `window`
    uses, at most `max_keys` keys (the least recently used forgotten). Thread-safe: the disk
    tier asks it under its own lock while host memory records under another."""

    window: int = 4096
    max_keys: int = 1 << 16
    _counts: cachetools.LRUCache[str, float] = field(init=False, repr=False)
    _uses: int = field(init=False, default=0)
    _lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.window < 1 or self.max_keys < 1:
            raise ValueError("window and max_keys must be positive")
        self._counts = cachetools.LRUCache(maxsize=self.max_keys)

    def record(self, key: str) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0.0) + 1.0
            self._uses += 1
            if self._uses >= self.window:
                self._uses = 0
                for name in list(self._counts):
                    self._counts[name] /= 2

    def count(self, key: str) -> float:
        with self._lock:
            return self._counts.get(key, 0.0)


@dataclass
class RetentionCosts:
    """What the utility is measured in, learned as the server runs (see the priors).
    `measured_prefill`: the server's own prefill seconds per token, None until it has one."""

    measured_prefill: Callable[[], float | None] | None = None
    prior_prefill_s_per_token: float = PRIOR_PREFILL_S_PER_TOKEN
    lower_bytes_per_s: float = PRIOR_LOWER_BYTES_PER_S
    size_ratio: dict[str, float] = field(default_factory=lambda: dict(PRIOR_SIZE_RATIO))
    step_error: dict[str, float] = field(default_factory=lambda: dict(PRIOR_STEP_ERROR))
    decode_s_per_byte: dict[str, float] = field(
        default_factory=lambda: dict(PRIOR_DECODE_S_PER_BYTE)
    )

    def prefill_s_per_token(self) -> float:
        measured = self.measured_prefill() if self.measured_prefill is not None else None
        return measured if measured is not None and measured > 0 else self.prior_prefill_s_per_token

    def note_compression(
        self, to: str, ratio: float, error: float, decode_s: float, nbytes: int
    ) -> None:
        """A compression to `to` stored `ratio` of its source's bytes, added `error`, and its
        `nbytes` decode in `decode_s`."""
        self.size_ratio[to] = _moved(self.size_ratio[to], ratio)
        self.step_error[to] = _moved(self.step_error[to], error)
        if nbytes > 0:
            self.decode_s_per_byte[to] = _moved(self.decode_s_per_byte[to], decode_s / nbytes)


def _moved(average: float, sample: float) -> float:
    return (1 - LEARNING_RATE) * average + LEARNING_RATE * sample


class UtilityRetention(Generic[V]):
    """The utility order of host memory (see the module doc). `bind` gives it the owner's
    `ChunkForms` before the first insert; host memory calls `stored`, `read`, `forget` as
    entries come, are read and go, and `make_room`/`plan` while it holds its own lock (one
    host memory per retention)."""

    def __init__(
        self,
        max_error: float,
        costs: RetentionCosts | None = None,
        uses: UseCounts | None = None,
        admission: FrequencyAdmission | None = None,
    ) -> None:
        if not 0 <= max_error < 1:
            raise ValueError(f"max_error must be in [0, 1), got {max_error}")
        self.max_error = max_error
        self.costs = costs or RetentionCosts()
        self.uses = uses or UseCounts()
        self.admission = admission
        self.forms: ChunkForms[V] | None = None
        self.counts: Counter[str] = Counter()
        self._errors: dict[str, float] = {}  # accumulated KV error of each compressed chunk
        self._first_bytes: dict[str, int] = {}  # bytes when stored: what a lower tier reads
        self._refused: dict[str, set[str]] = {}  # key -> the forms it failed the floor in

    def bind(self, forms: ChunkForms[V]) -> None:
        self.forms = forms

    def _forms(self) -> ChunkForms[V]:
        if self.forms is None:
            raise RuntimeError("UtilityRetention.bind was not called")
        return self.forms

    # -- what host memory tells it ---------------------------------------------------------

    def stored(self, key: str, value: V) -> None:
        """`key` was stored (or replaced by the owner) as `value`: a use, and its bytes."""
        self.uses.record(key)
        self._first_bytes[key] = self._forms().nbytes(value)
        self._errors.pop(key, None)
        self._refused.pop(key, None)

    def read(self, key: str) -> None:
        self.uses.record(key)

    def forget(self, key: str) -> None:
        """`key` left host memory."""
        self._errors.pop(key, None)
        self._first_bytes.pop(key, None)
        self._refused.pop(key, None)

    def frequency(self, key: str) -> float:
        """Expected reuse of `key`: its decayed uses, or its sights in the admission's sketch
        when those are more (a piece seen in prompts before it was stored)."""
        seen = self.admission.estimate(key) if self.admission is not None else 0
        return max(self.uses.count(key), float(seen))

    # -- the order -------------------------------------------------------------------------

    def held(self, key: str, value: V) -> Held:
        forms = self._forms()
        return Held(
            key, forms.nbytes(value), forms.tokens(value), forms.form(value), forms.below(key)
        )

    def cheapest(
        self, held: Sequence[Held], frequencies: dict[str, float] | None = None
    ) -> Move | None:
        """The move that loses the least worth per byte freed (the first held on a tie);
        None when nothing held can free a byte. `frequencies`: those of `held`, if known."""
        if frequencies is None:
            frequencies = {chunk.key: self.frequency(chunk.key) for chunk in held}
        best: Move | None = None
        for chunk in held:
            for move in self._moves(chunk, frequencies[chunk.key]):
                if best is None or move.cost < best.cost:
                    best = move
        return best

    def plan(self, held: Sequence[Held], need: int) -> list[Move] | None:
        """The moves that would free `need` bytes, in order, with the learned sizes; None when
        everything held cannot free them."""
        left = {chunk.key: chunk for chunk in held}
        frequencies = {key: self.frequency(key) for key in left}
        moves: list[Move] = []
        freed = 0
        while freed < need:
            move = self.cheapest(list(left.values()), frequencies)
            if move is None:
                return None
            moves.append(move)
            freed += move.freed
            chunk = left.pop(move.key)
            if move.to is not None:
                left[move.key] = chunk._replace(nbytes=chunk.nbytes - move.freed, form=move.to)
        return moves

    def _moves(self, chunk: Held, frequency: float) -> list[Move]:
        worth_now = self._saves(chunk.key, chunk.form, chunk.nbytes, chunk.tokens)
        dropped = self._saves_below(chunk.key, chunk.tokens) if chunk.below else 0.0
        drop_cost = frequency * (worth_now - dropped) / max(1, chunk.nbytes)
        moves = [Move(chunk.key, None, chunk.nbytes, drop_cost)]
        to = NEXT_FORM.get(chunk.form)
        if to is not None and to not in self._refused.get(chunk.key, ()):
            error = self._errors.get(chunk.key, 0.0) + self.costs.step_error[to]
            smaller = int(chunk.nbytes * self.costs.size_ratio[to])
            if error <= self.max_error and smaller < chunk.nbytes:
                worth = self._saves(chunk.key, to, smaller, chunk.tokens, error)
                freed = chunk.nbytes - smaller
                moves.append(Move(chunk.key, to, freed, frequency * (worth_now - worth) / freed))
        return moves

    def _saves(
        self, key: str, form: str, nbytes: int, tokens: int, error: float | None = None
    ) -> float:
        """Prefill seconds a reuse saves with the chunk in host memory in `form`."""
        error = self._errors.get(key, 0.0) if error is None else error
        prefill = tokens * self.costs.prefill_s_per_token()
        return (1 - error) * prefill - self.costs.decode_s_per_byte[form] * nbytes

    def _saves_below(self, key: str, tokens: int) -> float:
        load = self._first_bytes.get(key, 0) / self.costs.lower_bytes_per_s
        return tokens * self.costs.prefill_s_per_token() - load

    # -- making room -----------------------------------------------------------------------

    def compressed(self, key: str, value: V, to: str) -> V | None:
        """`value` compressed to `to` if its error stays within the floor (counted as
        `compressed_to_<form>`); None, counted as `compression_refused`, when it does not (the
        chunk keeps its form and never tries `to` again) or the codec fails."""
        forms = self._forms()
        began = time.perf_counter()
        try:
            smaller, step_error = forms.compress(key, value, to)
        except (CorruptChunkError, ValueError, RuntimeError, OSError) as err:
            logger.error(
                "hicache_ext retention: chunk %s not compressed to %s: %s", key[:12], to, err
            )
            self._refused.setdefault(key, set()).add(to)
            self.counts["compression_refused"] += 1
            return None
        spent = time.perf_counter() - began
        before, after = forms.nbytes(value), forms.nbytes(smaller)
        # Encoding and the check's decode both ran: half of it is a request's decode.
        self.costs.note_compression(to, after / max(1, before), step_error, spent / 2, after)
        error = self._errors.get(key, 0.0) + step_error
        if error > self.max_error or after >= before:
            self._refused.setdefault(key, set()).add(to)
            self.counts["compression_refused"] += 1
            return None
        self._errors[key] = error
        self.counts[f"compressed_to_{to}"] += 1
        return smaller
