"""Host memory's cache of precomputed chunk KV, with a byte capacity and LRU eviction.

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
refused. Eviction stays least recently used; admission decides only who may cause one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import cachetools

from sglang_hicache_ext.tiers.chunks.admission import FrequencyAdmission


class HasNbytes(Protocol):
    @property
    def nbytes(self) -> int: ...


V = TypeVar("V", bound=HasNbytes)


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


class NotAdmittedError(HostCacheFullError):
    """An insert by frequency that was seen no more often than an entry it would evict."""


class _AllPinnedError(Exception):
    """An insert still does not fit and every entry left is pinned."""


# Not `cachetools.LRUCache`: it keeps its recency order to itself and iterates in insertion
# order, and both the eviction past pinned entries and `items` need the recency order. A plain
# `Cache` whose own order is the recency does: an insert appends, `touch` re-inserts at the end.
class _PinnedLru(cachetools.Cache[str, V]):
    """Entries bounded by the sum of their `nbytes`, iterated least recently used first.

    `Cache` calls `popitem` while an insert does not fit: it evicts the least recently used
    entry that `pinned` does not hold and appends its key to `evicted` (the owner resets the
    list), or raises _AllPinnedError when every entry left is pinned (those evicted so far stay
    evicted, and the insert does not happen)."""

    def __init__(self, capacity_bytes: int, pinned: Callable[[str], bool]) -> None:
        super().__init__(capacity_bytes, getsizeof=lambda value: int(value.nbytes))
        self._pinned = pinned
        self.evicted: list[str] = []

    def touch(self, key: str) -> V:
        """The entry, made the most recently used."""
        value = self.pop(key)
        self[key] = value  # fits: its bytes were counted a moment ago
        return value

    def popitem(self) -> tuple[str, V]:
        oldest = next((key for key in self if not self._pinned(key)), None)
        if oldest is None:
            raise _AllPinnedError
        self.evicted.append(oldest)
        return oldest, self.pop(oldest)


class HostChunkCache(Generic[V]):
    """Thread-safe LRU by bytes; `get` refreshes recency; `pin`/`unpin` protect entries in use."""

    def __init__(self, capacity_bytes: int, admission: FrequencyAdmission | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self._capacity = capacity_bytes
        self.admission = admission
        self._pins: dict[str, int] = {}
        self._entries: _PinnedLru[V] = _PinnedLru(capacity_bytes, self._pinned_locked)
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
        """The entries an insert of `nbytes` new bytes would evict, least recently used first;
        None when it cannot fit (larger than the store, or the rest is pinned)."""
        free = self._capacity - self._entries.currsize
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
            if stored:
                try:
                    self._entries[key] = value  # evicts (`_PinnedLru.popitem`) until it fits
                except _AllPinnedError:
                    stored = False
            # A refused insert may have evicted entries before finding the rest pinned.
            self._counts["evictions"] += len(evicted)
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
            return self._entries.touch(key)

    def remove(self, key: str) -> bool:
        """Drop an entry; refused (False) while it is pinned. Unknown keys raise KeyError."""
        with self._lock:
            if key not in self._entries:
                raise KeyError(key)
            if self._pinned_locked(key):
                return False
            del self._entries[key]
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
            return HostCacheStats(*occupancy, **self._counts)

    def _pinned_locked(self, key: str) -> bool:
        """`pinned`, for a caller that holds the lock."""
        return self._pins.get(key, 0) > 0
