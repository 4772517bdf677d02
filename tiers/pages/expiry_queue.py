"""The page store's index entries ordered by expiry, soonest first (expiry and eviction order)."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable
from typing import NamedTuple

from sglang_hicache_ext.tiers.pages.page_records import IndexEntry


class QueuedExpiry(NamedTuple):
    expiry: float
    sequence: int  # ties in push order; entries themselves are never compared
    entry: IndexEntry


class ExpiryQueue:
    """A lazy min-heap: an entry's expiry is pushed again on every change, and an item whose
    entry has left the index or has a newer expiry is skipped when it comes up.
    Not thread-safe: the store calls it under its lock."""

    def __init__(self, entries: dict[str, IndexEntry]) -> None:
        self._entries = entries  # the store's index, shared: what "current" means
        self._heap: list[QueuedExpiry] = []
        self._sequence = itertools.count()

    def push(self, entry: IndexEntry) -> None:
        """Queue `entry` at its (new) `expiry`."""
        heapq.heappush(self._heap, QueuedExpiry(entry.expiry, next(self._sequence), entry))
        if len(self._heap) > 4 * len(self._entries) + 64:  # mostly stale items: rebuild
            self._heap = [
                QueuedExpiry(e.expiry, next(self._sequence), e) for e in self._entries.values()
            ]
            heapq.heapify(self._heap)

    def pop(self, before: float = math.inf) -> QueuedExpiry | None:
        """The current item expiring soonest, if it expires before `before`; stale items on
        the way are dropped."""
        while self._heap and self._heap[0].expiry < before:
            item = heapq.heappop(self._heap)
            if self._entries.get(item.entry.key) is item.entry and item.entry.expiry == item.expiry:
                return item
        return None

    def put_back(self, items: Iterable[QueuedExpiry]) -> None:
        """Re-queue popped items unchanged (pinned entries that could not be evicted)."""
        for item in items:
            heapq.heappush(self._heap, item)
