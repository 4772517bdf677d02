"""Records of the page store's index: the mutable entry per page and the frozen views it reports."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PageInfo:
    key: str
    group: str
    size_bytes: int  # file bytes, header included
    write_time: float
    last_access: float
    expiry: float


@dataclass(frozen=True)
class PageStoreStats:
    entries: int
    used_bytes: int
    reserved_bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    expired: int
    evicted: int
    rejected_writes: int  # no room even after eviction (e.g. everything pinned) or page too big
    write_errors: int  # OS errors while writing (full disk, I/O error); the put returned False
    corrupt_pages: int  # failed a checksum / length / key check, removed, never served
    removed_temp_files: int  # partial writes found on open
    refreshes: int  # TTL refreshes without a read (`touch`)
    io_errors: int  # other OS errors: listing, stat, delete, read (the page is dropped)


# The counters of `PageStoreStats`, kept by the store (and its page directory) under its lock.
STAT_COUNTERS = (
    "hits",
    "misses",
    "expired",
    "evicted",
    "rejected_writes",
    "write_errors",
    "corrupt_pages",
    "removed_temp_files",
    "refreshes",
    "io_errors",
)


class IndexEntry:
    """Mutable index record of one page file; only touched under the store lock."""

    __slots__ = (
        "doomed",
        "expiry",
        "group",
        "key",
        "last_access",
        "path",
        "readers",
        "size",
        "write_time",
    )

    def __init__(self, key: str, group: str, size: int, write_time: float, path: Path) -> None:
        self.key, self.group, self.size, self.path = key, group, size, path
        self.write_time = self.last_access = write_time
        self.expiry = math.inf
        self.readers = 0
        self.doomed = False  # expired or evicted while pinned: delete when the last reader leaves

    def info(self) -> PageInfo:
        return PageInfo(
            self.key, self.group, self.size, self.write_time, self.last_access, self.expiry
        )
