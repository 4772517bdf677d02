"""Host memory's cache of precomputed chunk KV, with a byte capacity: LRU, or retention by utility.

Keys are content hashes of the chunk's token ids (the same text always maps to the same entry,
so registration is idempotent). Values are any object that reports its size in `nbytes`
(a precomputed chunk: per-layer K and V). An entry pinned by a request that is reusing it is
never evicted under that request; when everything left is pinned, a new entry is refused
rather than overfilling the capacity.

With a `FrequencyAdmission` (`admission.py`), an insert that asks for it (`by_frequency`: the
pieces kept from traffic, never a registration) must win its place: when it does not fit in the
free bytes, it evicts the least recently used entries only if it was seen more often than each
of them, and is refused (NotAdmittedError, counted) otherwise; `would_admit` asks the same
question without storing, so a caller can skip the work of preparing a piece that would be
refused. Admission decides only who may cause an eviction.

Which entries make room is least recently used, or, with a `UtilityRetention`
(`retention.py`), the moves that lose the least worth per byte: an entry compressed one step
(dense -> int8 -> int4, within its quality floor) or dropped. Admission then weighs the
candidate against the entries that plan would drop: one that only compresses others costs no
entry its place.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Generic

from sglang_hicache_ext.tiers.chunks.admission import FrequencyAdmission
from sglang_hicache_ext.tiers.chunks.pinned_lru import AllPinnedError, PinnedLru, V
from sglang_hicache_ext.tiers.chunks.retention import Held, UtilityRetention

# The retention weighs the least recently used entries only, as many as this (Redis's sampled
# eviction, with a wider sample): a chunk read lately is worth keeping whatever its form, and
# the scan then costs the same on the scheduler thread whether host memory holds a hundred
# chunks or a hundred thousand.
RETENTION_WINDOW = 128


class HostCacheFullError(RuntimeError):
    """The entry does not fit even after evicting every unpinned entry."""


@dataclass(frozen=True)
class LruCounts:
    """What a byte-budgeted LRU of chunks counts (host memory here, the disk tier too)."""

    entries: int
    bytes_used: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int


@dataclass(frozen=True)
class HostCacheStats(LruCounts):
    rejected: int
    # Inserts asking for admission by frequency that did not fit in the free bytes: those that
    # were seen more often than the entries they evicted, and those refused at the door.
    admitted_by_frequency: int
    refused_by_frequency: int
    # Inserts that did not fit, admitted while the adaptive admission followed recency.
    admitted_by_recency: int
    # Retention by utility: entries compressed to make room, and compressions not kept (over
    # the quality floor, or the codec failed).
    compressed_to_int8: int = 0
    compressed_to_int4: int = 0
    compression_refused: int = 0
    # Bytes held per form ("none": dense rows), with a retention (which knows the forms).
    bytes_by_form: dict[str, int] = field(default_factory=dict)


class NotAdmittedError(HostCacheFullError):
    """An insert by frequency that was seen no more often than an entry it would evict."""


class HostChunkCache(Generic[V]):
    """Thread-safe LRU by bytes; `get` refreshes recency; `pin`/`unpin` protect entries in use."""

    def __init__(
        self,
        capacity_bytes: int,
        admission: FrequencyAdmission | None = None,
        retention: UtilityRetention[V] | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self._capacity = capacity_bytes
        self.admission = admission
        self.retention = retention  # None: the least recently used make room
        self._pins: dict[str, int] = {}
        self._entries: PinnedLru[V] = PinnedLru(capacity_bytes, self._pinned_locked, self._describe)
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(
            (
                "hits",
                "misses",
                "evictions",
                "rejected",
                "admitted_by_frequency",
                "refused_by_frequency",
                "admitted_by_recency",
            ),
            0,
        )

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def peek(self, key: str) -> V | None:
        """The entry without touching recency or hit counts (listing, diagnostics)."""
        with self._lock:
            return self._entries.get(key)

    def items(self) -> list[tuple[str, V]]:
        """Stored entries, least recently used first, without touching recency or hit counts."""
        with self._lock:
            return list(self._entries.items())

    def would_admit(self, key: str, nbytes: int) -> bool:
        """Whether `put(key, <nbytes>, by_frequency=True)` would store it now (nothing counted):
        stored already, fits in the free bytes, or seen more often than each entry it would
        evict. False also when it could not fit at all."""
        with self._lock:
            if self.admission is None or key in self._entries:
                return True
            victims = self._victims_locked(nbytes)
            return victims is not None and self.admission.admit(key, victims, count=False)

    def _victims_locked(self, nbytes: int) -> list[str] | None:
        """The entries an insert of `nbytes` new bytes would evict, least recently used first
        (with a retention: those its plan drops); None when it cannot fit (larger than the
        store, or the rest is pinned)."""
        free = self._capacity - self._entries.currsize
        if self.retention is not None:
            if free >= nbytes:
                return []
            moves = self.retention.plan(self._held_locked(), nbytes - free)
            return None if moves is None else [m.key for m in moves if m.to is None]
        victims: list[str] = []
        for key in self._entries:
            if free >= nbytes:
                break
            if not self._pinned_locked(key):
                victims.append(key)
                free += int(self._entries[key].nbytes)
        return victims if free >= nbytes else None

    def put(
        self,
        key: str,
        value: V,
        *,
        evict: bool = True,
        if_absent: bool = False,
        by_frequency: bool = False,
    ) -> list[str]:
        """Store `value`; returns the keys evicted to make room. Re-putting a key replaces it
        (unless `if_absent`: then a stored key is left as it is). Without `evict`, a value that
        does not fit in the free bytes is refused (HostCacheFullError) instead of evicting
        others. With `by_frequency` (and an admission), a new key that does not fit in the free
        bytes evicts only entries seen less often than itself (NotAdmittedError otherwise)."""
        size = int(value.nbytes)
        with self._lock:
            if size > self._capacity:
                self._counts["rejected"] += 1
                raise HostCacheFullError(
                    f"entry {key[:12]} needs {size} bytes; the store holds {self._capacity}"
                )
            if if_absent and key in self._entries:
                return []
            if by_frequency and self.admission is not None and key not in self._entries:
                self._admit_locked(key, size)
            old = self._entries.pop(key, None)
            self._entries.evicted = evicted = []
            stored = evict or self._entries.currsize + size <= self._capacity
            if stored and evict and self.retention is not None:
                self._make_room_locked(size)
            if stored:
                try:
                    self._entries[key] = value  # evicts (`PinnedLru.popitem`) until it fits
                except AllPinnedError:
                    stored = False
            # A refused insert may have evicted entries before finding the rest pinned.
            self._counts["evictions"] += len(evicted)
            if self.retention is not None:
                for gone in evicted:
                    self.retention.forget(gone)
                if stored:
                    self.retention.stored(key, value)
            if not stored:
                if old is not None:  # keep what was stored: a failed replace must not lose it
                    self._entries[key] = old
                self._counts["rejected"] += 1
                raise HostCacheFullError(
                    f"entry {key[:12]} needs {size} bytes; "
                    f"{self._capacity - self._entries.currsize} are free "
                    "and the rest is pinned by running requests"
                )
            return evicted

    def _held_locked(self) -> list[Held]:
        """What the retention may give up: the `RETENTION_WINDOW` least recently used unpinned
        entries, in that order."""
        assert self.retention is not None
        held: list[Held] = []
        for key, value in self._entries.items():
            if len(held) == RETENTION_WINDOW:
                break
            if not self._pinned_locked(key):
                held.append(self.retention.held(key, value))
        return held

    def _make_room_locked(self, nbytes: int) -> None:
        """Apply the retention's cheapest moves until `nbytes` fit in the free bytes (or nothing
        unpinned is left to give up: the insert then finds the rest pinned). Drops go to
        `_entries.evicted`; a compression keeps the entry's place in the recency order."""
        assert self.retention is not None
        while self._capacity - self._entries.currsize < nbytes:
            move = self.retention.cheapest(self._held_locked())
            if move is None:
                return
            if move.to is None:
                del self._entries[move.key]
                self._entries.evicted.append(move.key)
                continue
            smaller = self.retention.compressed(move.key, self._entries[move.key], move.to)
            if smaller is not None:
                self._entries[move.key] = smaller  # smaller: no eviction, same place

    def _admit_locked(self, key: str, size: int) -> None:
        """Raise NotAdmittedError unless `key` may take the room `size` new bytes need."""
        victims = self._victims_locked(size)
        if victims is None:
            return  # cannot fit at all: `put` refuses it as full
        if not victims:
            return  # fits in the free bytes: no one loses a place, nothing to decide
        assert self.admission is not None
        by_recency = self.admission.mode == "recency"
        if self.admission.admit(key, victims):
            self._counts["admitted_by_recency" if by_recency else "admitted_by_frequency"] += 1
            return
        self._counts["refused_by_frequency"] += 1
        raise NotAdmittedError(
            f"entry {key[:12]} was seen no more often than the {len(victims)} entries it "
            "would evict"
        )

    def get(self, key: str) -> V | None:
        with self._lock:
            if key not in self._entries:
                self._counts["misses"] += 1
                return None
            self._counts["hits"] += 1
            if self.retention is not None:
                self.retention.read(key)
            return self._entries.touch(key)

    def remove(self, key: str) -> bool:
        """Drop an entry; refused (False) while it is pinned. Unknown keys raise KeyError."""
        with self._lock:
            if key not in self._entries:
                raise KeyError(key)
            if self._pinned_locked(key):
                return False
            del self._entries[key]
            if self.retention is not None:
                self.retention.forget(key)
            return True

    def pinned(self, key: str) -> bool:
        """Whether a running request holds `key`."""
        with self._lock:
            return self._pinned_locked(key)

    def pin(self, key: str) -> V:
        """Take a reference that keeps the entry resident; KeyError if it is not stored.

        A lookup like `get` (fusion reads chunks this way), so it counts as a hit or a miss."""
        with self._lock:
            if key not in self._entries:
                self._counts["misses"] += 1
                raise KeyError(key)
            self._counts["hits"] += 1
            if self.retention is not None:
                self.retention.read(key)
            self._pins[key] = self._pins.get(key, 0) + 1
            return self._entries.touch(key)

    def unpin(self, key: str) -> None:
        with self._lock:
            count = self._pins.get(key, 0)
            if count <= 0:
                raise ValueError(f"entry {key[:12]} is not pinned")
            if count == 1:
                del self._pins[key]
            else:
                self._pins[key] = count - 1

    def stats(self) -> HostCacheStats:
        with self._lock:
            occupancy = (len(self._entries), self._entries.currsize, self._capacity)
            retained: dict[str, Any] = {}
            if self.retention is not None and self.retention.forms is not None:
                by_form = dict(self._entries.bytes_by_form)
                retained = {**self.retention.counts, "bytes_by_form": by_form}
            return HostCacheStats(*occupancy, **self._counts, **retained)

    def _describe(self, value: V) -> tuple[str, int] | None:
        """An entry's form and bytes for `bytes_by_form` (None without a retention: it knows the
        forms, and is bound to them before anything is stored)."""
        if self.retention is None or (forms := self.retention.forms) is None:
            return None
        return forms.form(value), forms.nbytes(value)

    def _pinned_locked(self, key: str) -> bool:
        """`pinned`, for a caller that holds the lock."""
        return self._pins.get(key, 0) > 0
