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
place of the entries an eviction would drop only when it has been seen more often than each. Nothing here
imports SGLang; the chunk tiers decide what a key is and when a sight counts.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

MAX_COUNT = 15  # TinyLFU's 4-bit counters: enough to order frequencies in one window
DEPTH = 4  # counter rows of the count-min sketch (one index per row)
_HEADER = struct.Struct("<4sIIIQ")  # magic, width, doorkeeper bits, sample size, sights
_MAGIC = b"TLFU"


def _digest(key: str) -> tuple[int, int]:
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

    def _slots(self, key: str) -> tuple[np.ndarray, list[int]]:
        first, step = _digest(key)
        mask = self.width - 1
        columns = np.array([(first + i * step) & mask for i in range(DEPTH)], dtype=np.int64)
        door_mask = self.doorkeeper_bits - 1
        bits = [((first >> 32) + i * (step >> 1)) & door_mask for i in range(3)]
        return columns, bits

    def _in_doorkeeper(self, bits: list[int]) -> bool:
        return all(self.doorkeeper[b >> 3] & (1 << (b & 7)) for b in bits)

    def record(self, key: str) -> None:
        """One sight of `key`."""
        columns, bits = self._slots(key)
        if not self._in_doorkeeper(bits):
            for b in bits:
                self.doorkeeper[b >> 3] |= np.uint8(1 << (b & 7))
        else:
            rows = np.arange(DEPTH)
            current = self.counters[rows, columns]
            # Conservative update: only the smallest counters grow, which keeps the
            # overestimate of keys that share a slot with a popular one small.
            low = current == current.min()
            grow = low & (current < MAX_COUNT)
            self.counters[rows[grow], columns[grow]] += np.uint8(1)
        self.sights += 1
        if self.sights >= self.sample_size:
            self._halve()

    def estimate(self, key: str) -> int:
        """How often `key` was seen in the window (decayed): 0 for a key never seen, 1 after
        one sight; may be too high when keys collide, never too low."""
        columns, bits = self._slots(key)
        count = int(self.counters[np.arange(DEPTH), columns].min())
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


@dataclass
class FrequencyAdmission:
    """TinyLFU's admission decision over a `FrequencySketch`, with what it decided counted."""

    sketch: FrequencySketch
    admitted: int = 0
    refused: int = 0

    @classmethod
    def for_entries(cls, expected_keys: int) -> FrequencyAdmission:
        return cls(FrequencySketch.for_entries(expected_keys))

    def record(self, key: str) -> None:
        self.sketch.record(key)

    def admit(self, candidate: str, victims: Sequence[str], *, count: bool = True) -> bool:
        """Whether `candidate` should take the place of `victims` (the entries an eviction would
        drop for it, in the order it would drop them): only when it was seen more often than
        each of them. No victims (it fits as it is): admitted. A tie keeps the victim, which
        holds a popular entry against a stream of pieces seen as often as it once was.
        `count=False` asks without counting the answer (a look before the work it saves)."""
        best = max((self.sketch.estimate(victim) for victim in victims), default=-1)
        decision = self.sketch.estimate(candidate) > best
        if count:
            if decision:
                self.admitted += 1
            else:
                self.refused += 1
        return decision
