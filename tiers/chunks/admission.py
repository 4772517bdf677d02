"""Admission by frequency: which of two chunks has been seen more often, in bounded memory.

A TinyLFU frequency sketch (Einziger, Friedman and Manes, "TinyLFU: A Highly Efficient Cache
Admission Policy", 2017) over content hashes of chunk pieces: a count-min sketch of small
saturating counters behind a doorkeeper Bloom filter. A key's first sight only sets its
doorkeeper bits; later sights add to the counters. Every `sample_size` recorded sights all
counters are halved and the doorkeeper is cleared, so the counts are a decayed frequency of
the recent window, not of all time.

The memory is fixed when the sketch is made (`memory_bytes`) whatever the number of distinct
keys: the estimate of a key may be too high (collisions), never too low within a window. Keys
are hashed with BLAKE2b, not Python's per-process `hash`, so a sketch written with `to_bytes`
reads back with the same answers after a restart.

`FrequencyAdmission.admit(candidate, victims)` is the TinyLFU decision: a new piece takes the
place of the entries an eviction would drop only when it has been seen more often than each.
Where most reuse is a piece's second sight (a conversation's next turn) that rule refuses what
would have been reused, so with a budget it is adaptive: two `StoreShadow`s replay every sight
with keys and sizes only, one admitting by frequency and one admitting everything, and the
decision follows the one that would have served more lately (the set-dueling idea of Qureshi
et al., "Adaptive Insertion Policies for High Performance Caching", 2007). Nothing here
imports SGLang; the chunk tiers decide what a key is and when a sight counts.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import cachetools
import numpy as np

MAX_COUNT = 15  # TinyLFU's 4-bit counters: enough to order frequencies in one window
DEPTH = 4  # counter rows of the count-min sketch (one index per row)
_HEADER = struct.Struct("<4sIIIQ")  # magic, width, doorkeeper bits, sample size, sights
_MAGIC = b"TLFU"


Digest = tuple[int, int]


def digest_of(key: str) -> Digest:
    """Two independent 64-bit hashes of `key` (double hashing derives every index from them)."""
    h = hashlib.blake2b(key.encode(), digest_size=16).digest()
    first, second = struct.unpack("<QQ", h)
    return first, second | 1  # an odd step visits every slot of a power-of-two table


@dataclass
class FrequencySketch:
    """Decayed sight counts of string keys in `width` x DEPTH counters and a doorkeeper.

    `width` (a power of two) sizes the counters, `doorkeeper_bits` (a power of two) the Bloom
    filter of first sights, `sample_size` the window: after that many `record` calls every
    count is halved. Raises ValueError for sizes that are not positive powers of two.
    """

    width: int
    doorkeeper_bits: int
    sample_size: int
    counters: np.ndarray = field(init=False, repr=False)
    doorkeeper: np.ndarray = field(init=False, repr=False)
    sights: int = field(init=False, default=0)  # recorded since the last halving
    halvings: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        for name, value in (("width", self.width), ("doorkeeper_bits", self.doorkeeper_bits)):
            if value < 8 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 8, got {value}")
        if self.sample_size < 1:
            raise ValueError(f"sample_size must be >= 1, got {self.sample_size}")
        self.counters = np.zeros((DEPTH, self.width), dtype=np.uint8)
        self.doorkeeper = np.zeros(self.doorkeeper_bits // 8, dtype=np.uint8)

    @classmethod
    def for_entries(cls, expected_keys: int) -> FrequencySketch:
        """A sketch for a cache of `expected_keys` entries: as many counters per row, rounded up
        to a power of two; a window of ten sights per counter (the paper's W = 10 C); and a
        doorkeeper of 8 bits per sight of a window, so that even a window of keys all distinct
        (a long tail of one-offs) leaves few false "seen before" (about 3 % with its 3 bits)."""
        width = 1 << max(3, (max(1, expected_keys) - 1).bit_length())
        sample_size = 10 * width
        door_bits = 1 << (8 * sample_size - 1).bit_length()
        return cls(width=width, doorkeeper_bits=door_bits, sample_size=sample_size)

    @property
    def memory_bytes(self) -> int:
        return self.counters.nbytes + self.doorkeeper.nbytes

    def _slots(self, digest: Digest) -> tuple[list[int], list[int]]:
        first, step = digest
        mask = self.width - 1
        columns = [(first + i * step) & mask for i in range(DEPTH)]
        door_mask = self.doorkeeper_bits - 1
        bits = [((first >> 32) + i * (step >> 1)) & door_mask for i in range(3)]
        return columns, bits

    def _in_doorkeeper(self, bits: list[int]) -> bool:
        return all(self.doorkeeper[b >> 3] & (1 << (b & 7)) for b in bits)

    def record(self, key: str) -> None:
        """One sight of `key`."""
        self.record_digest(digest_of(key))

    def record_digest(self, digest: Digest) -> None:
        """`record` of the key whose `digest_of` this is."""
        columns, bits = self._slots(digest)
        if not self._in_doorkeeper(bits):
            for b in bits:
                self.doorkeeper[b >> 3] |= np.uint8(1 << (b & 7))
        else:
            rows = np.arange(DEPTH)
            current = self.counters[rows, np.array(columns, dtype=np.int64)]
            # Conservative update: only the smallest counters grow, which keeps the
            # overestimate of keys that share a slot with a popular one small.
            low = current == current.min()
            grow = low & (current < MAX_COUNT)
            self.counters[rows[grow], np.array(columns, dtype=np.int64)[grow]] += np.uint8(1)
        self.sights += 1
        if self.sights >= self.sample_size:
            self._halve()

    def estimate(self, key: str) -> int:
        """How often `key` was seen in the window (decayed): 0 for a key never seen, 1 after
        one sight; may be too high when keys collide, never too low."""
        return self.estimate_digest(digest_of(key))

    def estimate_digest(self, digest: Digest) -> int:
        """`estimate` of the key whose `digest_of` this is."""
        columns, bits = self._slots(digest)
        count = min(int(self.counters[row, column]) for row, column in enumerate(columns))
        return count + (1 if self._in_doorkeeper(bits) else 0)

    def _halve(self) -> None:
        self.counters >>= 1
        self.doorkeeper[:] = 0
        self.sights //= 2
        self.halvings += 1

    def to_bytes(self) -> bytes:
        """The whole state, for a restart (`from_bytes` reads it back)."""
        header = _HEADER.pack(
            _MAGIC, self.width, self.doorkeeper_bits, self.sample_size, self.sights
        )
        return header + self.counters.tobytes() + self.doorkeeper.tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> FrequencySketch:
        """A sketch written by `to_bytes`. Raises ValueError when `data` is not one (a wrong
        magic or length: a truncated or foreign file), so a caller can start empty instead."""
        if len(data) < _HEADER.size:
            raise ValueError("frequency sketch: too short")
        magic, width, door_bits, sample_size, sights = _HEADER.unpack_from(data)
        if magic != _MAGIC:
            raise ValueError("frequency sketch: not a sketch (bad magic)")
        sketch = cls(width=width, doorkeeper_bits=door_bits, sample_size=sample_size)
        body = data[_HEADER.size :]
        if len(body) != sketch.memory_bytes:
            raise ValueError(
                f"frequency sketch: {len(body)} bytes of state, expected {sketch.memory_bytes}"
            )
        counters = np.frombuffer(body[: sketch.counters.nbytes], dtype=np.uint8)
        sketch.counters[:] = counters.reshape(DEPTH, width)
        sketch.doorkeeper[:] = np.frombuffer(body[sketch.counters.nbytes :], dtype=np.uint8)
        sketch.sights = sights
        return sketch


class StoreShadow:
    """The keys and sizes host memory would hold under one admission rule, and the bytes it
    would have served, with no values: what that rule would have done with the same sights.

    Host memory (`capacity_bytes`) evicts the least recently used. With `by_frequency`, a key
    that does not fit in its free bytes enters only when `sketch` counts it seen more often
    than each key it would evict (TinyLFU's rule); without, every key enters (plain LRU). With
    `lower_bytes`, a disk tier below: every key host memory takes is written through to it (an
    LRU of that budget), a key found only there is served and promoted back without
    admission, as `ChunkTiers` does. Holds at most the keys that fit in the budgets, about 100
    bytes each."""

    def __init__(
        self, capacity_bytes: int, by_frequency: bool, lower_bytes: int | None = None
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self.by_frequency = by_frequency
        self.entries: OrderedDict[Digest, int] = OrderedDict()  # least recently used first
        self.used = 0
        self.lower = None if lower_bytes is None else StoreShadow(lower_bytes, by_frequency=False)
        self.hit_bytes = 0.0  # decayed by the owner, as the sketch's counts are

    def sight(self, digest: Digest, nbytes: int, sketch: FrequencySketch) -> None:
        """One sight of a key of `nbytes`: a hit if held here or below, else stored if the
        rule lets it in."""
        if digest in self.entries:
            self.entries.move_to_end(digest)
            self.hit_bytes += nbytes
            return
        if self.lower is not None and digest in self.lower.entries:
            self.lower.entries.move_to_end(digest)
            self.hit_bytes += nbytes
            self._store(digest, nbytes, self._victims(nbytes))  # promoted: no admission
            return
        victims = self._victims(nbytes)
        if victims is None:
            return
        if self.by_frequency and victims:
            best = max(sketch.estimate_digest(victim) for victim in victims)
            if sketch.estimate_digest(digest) <= best:
                return
        self._store(digest, nbytes, victims)
        if self.lower is not None:
            self.lower.insert(digest, nbytes)

    def insert(self, digest: Digest, nbytes: int) -> None:
        """Store a key, evicting the least recently used (a write-through from above)."""
        if digest in self.entries:
            self.entries.move_to_end(digest)
            return
        self._store(digest, nbytes, self._victims(nbytes))

    def _victims(self, nbytes: int) -> list[Digest] | None:
        """The keys an insert of `nbytes` would evict, least recently used first; None when it
        is larger than the budget."""
        if nbytes > self.capacity_bytes:
            return None
        victims: list[Digest] = []
        free = self.capacity_bytes - self.used
        for key, size in self.entries.items():
            if free >= nbytes:
                break
            victims.append(key)
            free += size
        return victims

    def _store(self, digest: Digest, nbytes: int, victims: list[Digest] | None) -> None:
        if victims is None:
            return
        for victim in victims:
            self.used -= self.entries.pop(victim)
        self.entries[digest] = nbytes
        self.used += nbytes


Mode = Literal["frequency", "recency"]
LEAD_MEMORY = 4  # host memory's entries, times: how many recent sights the adaptive lead sums
# Lead spans (LEAD_MEMORY x entries held) during which the adaptive admission stays with
# frequency: while both shadows are still filling, the rule that admits everything serves the
# first second sights sooner, a lead that measures the fill rather than the traffic (on the
# live benchmark's mix it followed recency for 22 of its first 27 prompts and kept 0.898 of
# the popular tokens where frequency kept 0.933: research/admission_keys_replay.py).
WARM_UP_LEADS = 2
# ... and never past a sixteenth of the sketch's width in sights (1,024 at the default
# `chunk_admission_sketch_entries`): where host memory holds thousands of entries (the Mooncake
# conversation trace at 1x its reused set), two lead spans outlast the traffic recency should
# serve (its adaptive share of Belady's fell from 0.95 to 0.60 without the cap).
WARM_UP_CAP = 16


@dataclass
class FrequencyAdmission:
    """TinyLFU's admission decision over a `FrequencySketch`, with what it decided counted.

    With `capacity_bytes` (host memory's), adaptive: two `StoreShadow`s of that size (and of
    the disk tier's `lower_bytes` below, if any) replay every sight, one admitting by
    frequency, one admitting everything, and the decision follows the one that would have
    served more bytes lately (`mode`). Frequency wins where one-off pieces
    would push popular ones out; recency wins where most reuse is a piece's second sight (the
    next turn of a conversation), which admission by frequency refuses. Without it, always by
    frequency."""

    sketch: FrequencySketch
    capacity_bytes: int | None = None
    lower_bytes: int | None = None
    admitted: int = 0
    refused: int = 0
    shadows: dict[Mode, StoreShadow] = field(init=False, default_factory=dict)
    sights: int = field(init=False, default=0)  # recorded by `record_prompt`, for the warm-up
    # Stored keys -> the key their sights are counted under (`count_as`), for the keys that
    # differ: bounded like the sketch (an entry no longer named is estimated by its own key).
    _sight_keys: cachetools.LRUCache[str, str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._sight_keys = cachetools.LRUCache(maxsize=self.sketch.width)
        if self.capacity_bytes is not None:
            if self.capacity_bytes <= 0:
                raise ValueError(f"capacity_bytes must be positive, got {self.capacity_bytes}")
            self.shadows = {
                "frequency": StoreShadow(self.capacity_bytes, True, self.lower_bytes),
                "recency": StoreShadow(self.capacity_bytes, False, self.lower_bytes),
            }

    @classmethod
    def for_entries(
        cls, expected_keys: int, capacity_bytes: int | None = None, lower_bytes: int | None = None
    ) -> FrequencyAdmission:
        return cls(FrequencySketch.for_entries(expected_keys), capacity_bytes, lower_bytes)

    @property
    def mode(self) -> Mode:
        """How `admit` decides now: "frequency" (TinyLFU) or "recency" (every piece admitted).
        A tie, and the warm-up (`WARM_UP_LEADS` lead spans of sights, at most `WARM_UP_CAP`-th
        of the sketch's width), are frequency's."""
        if not self.shadows:
            return "frequency"
        warm_up = min(WARM_UP_LEADS * self._lead_span(), self.sketch.width // WARM_UP_CAP)
        if self.sights < warm_up:
            return "frequency"
        lead = self.shadows["frequency"].hit_bytes >= self.shadows["recency"].hit_bytes
        return "frequency" if lead else "recency"

    def count_as(self, key: str, sight_key: str) -> None:
        """Count the sights of stored `key` under `sight_key` (the key `record_prompt` is given
        for its content): `admit` then estimates `key`, as candidate or victim, by those. What
        a store names an entry by (its exact tokens) and what makes two sights the same (the
        content, wherever and under whatever label it appears) need not be one key."""
        if sight_key != key:
            self._sight_keys[key] = sight_key

    def estimate(self, key: str) -> int:
        """How often `key` was seen lately (by its sight key, `count_as`)."""
        return self.sketch.estimate(self._sight_keys.get(key, key))

    def record(self, key: str) -> None:
        """One sight of `key` in the sketch only (no size: the shadows do not see it)."""
        self.sketch.record(key)

    def record_prompt(self, sights: Sequence[tuple[str, int]]) -> None:
        """The sights of one prompt, `(key, nbytes)` each: all counted in the sketch first (so
        that none is judged before the prompt's others are counted), then replayed by the
        shadows in order."""
        digests = [(digest_of(key), nbytes) for key, nbytes in sights]
        self.sights += len(digests)
        for digest, _ in digests:
            self.sketch.record_digest(digest)
        for digest, nbytes in digests:
            for shadow in self.shadows.values():
                shadow.sight(digest, nbytes, self.sketch)
            if self.shadows:
                decay = self._decay()  # once a sight, from what both shadows hold after it
                for shadow in self.shadows.values():
                    shadow.hit_bytes *= decay

    def _decay(self) -> float:
        """The factor each sight scales what the shadows served by: the lead is a sum over
        about the last `LEAD_MEMORY` times as many sights as host memory holds entries, so a
        lead won while one rule had no time to show its worth (the warm-up) does not last."""
        return 1.0 - 1.0 / self._lead_span()

    def _lead_span(self) -> int:
        held = max(len(shadow.entries) for shadow in self.shadows.values())
        return LEAD_MEMORY * max(8, held)

    def admit(self, candidate: str, victims: Sequence[str], *, count: bool = True) -> bool:
        """Whether `candidate` should take the place of `victims` (the entries an eviction would
        drop for it, in the order it would drop them). By frequency: only when it was seen more
        often than each of them; no victims (it fits as it is): admitted. A tie keeps the
        victim, which holds a popular entry against a stream of pieces seen as often as it once
        was. By recency: always. `count=False` asks without counting the answer (a look before
        the work it saves)."""
        if self.mode == "recency":
            decision = True
        else:
            best = max((self.estimate(victim) for victim in victims), default=-1)
            decision = self.estimate(candidate) > best
        if count:
            if decision:
                self.admitted += 1
            else:
                self.refused += 1
        return decision
