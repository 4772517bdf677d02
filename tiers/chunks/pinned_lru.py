"""Entries bounded by the sum of their bytes, in recency order, that a pin keeps resident: the
container under host memory's chunk cache (`host_cache.py`), which decides what goes in and
what makes room; this only stores, evicts the least recently used unpinned entry when told to,
and keeps the bytes per form."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Protocol, TypeVar

import cachetools


class HasNbytes(Protocol):
    @property
    def nbytes(self) -> int: ...


V = TypeVar("V", bound=HasNbytes)


class AllPinnedError(Exception):
    """An insert still does not fit and every entry left is pinned."""


# Not `cachetools.LRUCache`: it keeps its recency order to itself and iterates in insertion
# order, and both the eviction past pinned entries and `items` need the recency order. A plain
# `Cache` whose own order is the recency does: an insert appends, `touch` re-inserts at the end.
class PinnedLru(cachetools.Cache[str, V]):
    """Entries bounded by the sum of their `nbytes`, iterated least recently used first.

    `Cache` calls `popitem` while an insert does not fit: it evicts the least recently used
    entry that `pinned` does not hold and appends its key to `evicted` (the owner resets the
    list), or raises AllPinnedError when every entry left is pinned (those evicted so far stay
    evicted, and the insert does not happen).

    `bytes_by_form` is kept as entries come and go (a walk on every read of it would cost the
    scheduler O(entries) per stored chunk): `describe` gives an entry's form and bytes, or None
    when the owner does not know forms (then nothing is counted)."""

    def __init__(
        self,
        capacity_bytes: int,
        pinned: Callable[[str], bool],
        describe: Callable[[V], tuple[str, int] | None],
    ) -> None:
        super().__init__(capacity_bytes, getsizeof=lambda value: int(value.nbytes))
        self._pinned = pinned
        self._describe = describe
        self._described: dict[str, tuple[str, int]] = {}
        self.bytes_by_form: Counter[str] = Counter()
        self.evicted: list[str] = []

    def __setitem__(self, key: str, value: V) -> None:
        super().__setitem__(key, value)  # its evictions pass through __delitem__
        self._forget_form(key)  # the value it replaced, if any
        self._note_form(key, value)

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        self._forget_form(key)

    def clear(self) -> None:
        # `Cache.clear` empties its data without `__delitem__`: the accounting goes with it.
        super().clear()
        self._described.clear()
        self.bytes_by_form.clear()

    def _note_form(self, key: str, value: V) -> None:
        if (described := self._describe(value)) is not None:
            self._described[key] = described
            self.bytes_by_form[described[0]] += described[1]

    def _forget_form(self, key: str) -> None:
        if (described := self._described.pop(key, None)) is None:
            return
        form, nbytes = described
        self.bytes_by_form[form] -= nbytes
        if not self.bytes_by_form[form]:
            del self.bytes_by_form[form]

    def touch(self, key: str) -> V:
        """The entry, made the most recently used."""
        value = self.pop(key)
        self[key] = value  # fits: its bytes were counted a moment ago
        return value

    def popitem(self) -> tuple[str, V]:
        oldest = next((key for key in self if not self._pinned(key)), None)
        if oldest is None:
            raise AllPinnedError
        self.evicted.append(oldest)
        return oldest, self.pop(oldest)
