"""The page store: HiCache's pages on a local disk, with group, size, write time and expiry,
under a hard byte capacity (the disk tier of `sglang_ext/disk_tier/`).

- TTL: expiry comes from the shared `TtlPolicy` (set on write, refreshed on every read).
- Capacity: bytes of page files (header included) never exceed `capacity_bytes`, also while
  writes are in flight: a writer reserves its bytes under the lock before touching the disk.
  (A page overwritten while a reader still has the old file open frees its old bytes only when
  that reader closes it; the accounting counts the files reachable by name.)
  When full, pages are dropped in order of soonest expiry (expired ones first, by construction).
- Crash safety: pages are written by `tiers/atomic_write.py` in the format of `page_file.py`; on
  open the index is rebuilt from the files, stray temp files and pages that fail the header
  check are removed (and counted); payload checksums are verified on every read, and a corrupt
  page is dropped instead of served.
- Readers pin an entry: neither expiry nor eviction deletes it until the last reader is done.
- After a restart, a page's expiry is recomputed from its last access (the file's mtime, which
  every read refreshes) and the TTL table of the new process.
- Ownership: one open store per root, in one process at a time (`tiers/dir_lock.py`): opening must
  delete stray temp files, which would otherwise be another store's writes in flight.
- Faults: OS errors never escape `put`/`get`/`touch`/`purge_expired` (False / miss / 0, logged,
  counted); only invalid arguments (an empty key, a negative TTL) raise `ValueError`: those are
  the caller's bugs and are refused before anything is touched.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from sglang_hicache_ext.radix.groups import RESIDUAL_GROUP
from sglang_hicache_ext.tiers.atomic_write import commit, fsync_directory, write_temp
from sglang_hicache_ext.tiers.dir_lock import DirectoryLock
from sglang_hicache_ext.tiers.pages.expiry_queue import ExpiryQueue, QueuedExpiry
from sglang_hicache_ext.tiers.pages.page_directory import PageDirectory, check_key
from sglang_hicache_ext.tiers.pages.page_file import CorruptPageError, encode_header, read_page
from sglang_hicache_ext.tiers.pages.page_records import (
    STAT_COUNTERS,
    IndexEntry,
    PageInfo,
    PageStoreStats,
)
from sglang_hicache_ext.tiers.pages.ttl_policy import TtlPolicy

logger = logging.getLogger(__name__)

STORE_LOCK_NAME = "store.lock"  # in the root, beside `pages/`


class PageStore:
    """Thread-safe TTL page store on a local directory. Keys are strings, values bytes."""

    def __init__(
        self,
        root: str | Path,
        capacity_bytes: int,
        policy: TtlPolicy,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.root = Path(root)
        self.capacity_bytes = int(capacity_bytes)
        self.policy = policy
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, IndexEntry] = {}
        self._expiry = ExpiryQueue(self._entries)
        self._used = 0
        self._reserved = 0
        self._counts = dict.fromkeys(STAT_COUNTERS, 0)
        self._expired_by_group: Counter[str] = Counter()  # the `expired` count split by group
        self._pages = PageDirectory(self.root / "pages", self._counts)
        self._closed = False
        self.root.mkdir(parents=True, exist_ok=True)
        self._dir_lock = DirectoryLock(self.root, STORE_LOCK_NAME)  # raises if held elsewhere
        try:
            self._rebuild_index()
        except BaseException:
            self._dir_lock.release()
            raise

    # -- public API ---------------------------------------------------------------------------

    def put(
        self, key: str, value: bytes, group: str = RESIDUAL_GROUP, ttl_s: float | None = None
    ) -> bool:
        """Store `value` under `key`; False (logged, counted) when it cannot be stored.

        `ttl_s` (the writer's TTL for this page, e.g. from the same policy at the time it
        decided) sets this write's expiry; later accesses refresh it from the policy.

        Never raises for storage faults. A write that fails before its rename (mkdir, temp
        write, fsync, rename) leaves what is stored under `key` untouched. One that fails after
        it (the directory fsync, so the new name may not survive a crash) returns False and
        leaves *no* page under `key`: the rename has already replaced the old file, and the new
        one is removed rather than indexed on a write the caller was told failed; a miss is
        always correct for a cache. Invalid arguments (empty key, bad TTL) raise `ValueError`
        before anything is touched: they are the caller's bugs, not storage faults.
        """
        check_key(key)
        if ttl_s is not None and not (math.isfinite(ttl_s) and ttl_s >= 0):
            raise ValueError(f"ttl_s must be finite and >= 0, got {ttl_s!r}")
        payload = bytes(value)
        now = self._clock()
        expiry = now + ttl_s if ttl_s is not None else self.policy.expiry_on_access(group, now)
        header = encode_header(key, group, payload, now, expiry)
        size = len(header) + len(payload)
        path = self._path_of(key)
        with self._lock:
            if self._closed:
                self._counts["rejected_writes"] += 1
                logger.warning("disk store %s is closed: rejected page %s", self.root, key)
                return False
            if not self._make_room(size):
                self._counts["rejected_writes"] += 1
                logger.warning("disk store full: rejected %d-byte page %s", size, key)
                return False
            self._reserved += size
        try:
            # parents=True: a pages folder removed under a running store comes back.
            path.parent.mkdir(parents=True, exist_ok=True)
            temp = write_temp(path, header, payload, mtime=now)
        except OSError as error:
            with self._lock:
                self._reserved -= size
                self._counts["write_errors"] += 1
            logger.error("disk store: writing page %s failed: %s", key, error)
            return False
        with self._lock:
            # Rename under the lock: the index and the file behind a name must change together.
            self._reserved -= size
            if self._closed:  # the directory may have a new owner: do not publish into it
                self._counts["rejected_writes"] += 1
                self._pages.unlink(temp)
                logger.warning(
                    "disk store %s closed during a write: page %s dropped", self.root, key
                )
                return False
            try:
                commit(temp, path)
            except OSError as error:
                self._counts["write_errors"] += 1
                logger.error("disk store: committing page %s failed: %s", key, error)
                return False
            old = self._entries.pop(key, None)
            if old is not None:
                self._used -= old.size  # the name now points at the new file
            entry = IndexEntry(key, group, size, now, path)
            self._entries[key] = entry
            self._used += size
            self._set_expiry(entry, now, expiry)
        try:
            fsync_directory(path.parent)  # the rename is durable before put returns True
        except OSError as error:
            with self._lock:
                self._counts["write_errors"] += 1
                # Un-index and delete it, unless a later put of the same key replaced it
                # meanwhile (then that file is not ours); a reader in flight defers the delete.
                entry.doomed = True
                self._release_if_doomed(entry)
            logger.error("disk store: syncing the folder of page %s failed: %s", key, error)
            return False
        return True

    def get(self, key: str) -> bytes | None:
        """The stored bytes (and refresh the page's TTL), or None when absent/expired/corrupt."""
        check_key(key)
        now = self._clock()
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not self._live(entry, now):
                self._counts["misses"] += 1
                return None
            entry.readers += 1
            entry.last_access = now
            self._set_expiry(entry, now)
        try:
            payload = self._read_file(entry)
        except (CorruptPageError, OSError) as error:
            logger.error("disk store: dropping unreadable page %s: %s", key, error)
            with self._lock:
                entry.readers -= 1
                # OSError: gone (folder removed under us) or an I/O error; either way a miss.
                self._counts["io_errors" if isinstance(error, OSError) else "corrupt_pages"] += 1
                self._counts["misses"] += 1
                entry.doomed = True
                self._release_if_doomed(entry)
            return None
        # Persist "last access" across restarts; if the file was replaced meanwhile, its new
        # owner has set its own time.
        with contextlib.suppress(OSError):
            os.utime(entry.path, (now, now))
        with self._lock:
            entry.readers -= 1
            self._counts["hits"] += 1
            self._release_if_doomed(entry)
        return payload

    def touch(self, keys: Sequence[str], groups: Sequence[str] | None = None) -> int:
        """Refresh the TTL of the live pages among `keys` (an access served by a faster tier);
        returns how many were refreshed. Nothing is read; expired pages stay expired.

        With `groups` (the pages' groups now: groupings change every period), a page moves to
        its new group before its expiry is recomputed; the file keeps its write-time group.
        """
        if groups is not None and len(groups) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(groups)} groups")
        now = self._clock()
        touched: list[Path] = []
        with self._lock:
            for i, key in enumerate(keys):
                entry = self._entries.get(key)
                if entry is None or entry.doomed or not self.policy.is_live(entry.expiry, now):
                    continue
                if groups is not None:
                    entry.group = groups[i]
                entry.last_access = now
                self._set_expiry(entry, now)
                touched.append(entry.path)
            self._counts["refreshes"] += len(touched)
        for path in touched:  # persist "last access" for the index rebuilt after a restart
            with contextlib.suppress(OSError):
                os.utime(path, (now, now))
        return len(touched)

    def contains(self, key: str) -> bool:
        """Whether a live page is stored (no TTL refresh)."""
        with self._lock:
            entry = self._entries.get(key)
            return entry is not None and self.policy.is_live(entry.expiry, self._clock())

    def info(self, key: str) -> PageInfo | None:
        with self._lock:
            entry = self._entries.get(key)
            return entry.info() if entry is not None else None

    def infos(self) -> list[PageInfo]:
        """Every indexed page, soonest expiry first."""
        with self._lock:
            entries = sorted(self._entries.values(), key=lambda e: e.expiry)
            return [entry.info() for entry in entries]

    def group_usage(self) -> dict[str, dict[str, int]]:
        """Pages and bytes on disk per group."""
        usage: dict[str, dict[str, int]] = {}
        with self._lock:
            for entry in self._entries.values():
                row = usage.setdefault(entry.group, {"pages": 0, "bytes": 0})
                row["pages"] += 1
                row["bytes"] += entry.size
        return usage

    def delete(self, key: str) -> bool:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return False
            entry.doomed = True
            self._release_if_doomed(entry)
            return True

    def purge_expired(self) -> int:
        """Remove expired pages not being read; returns how many were removed."""
        now = self._clock()
        removed = 0
        with self._lock:
            while (item := self._expiry.pop(before=now)) is not None:
                self._count_expiry(item.entry)
                item.entry.doomed = True
                removed += self._release_if_doomed(item.entry)
        return removed

    def stats(self) -> PageStoreStats:
        with self._lock:
            return PageStoreStats(
                entries=len(self._entries),
                used_bytes=self._used,
                reserved_bytes=self._reserved,
                capacity_bytes=self.capacity_bytes,
                **self._counts,
            )

    def expired_by_group(self) -> dict[str, int]:
        """Pages expired per group since the store opened (`stats().expired` is their sum)."""
        with self._lock:
            return dict(self._expired_by_group)

    def disk_usage_bytes(self) -> int:
        """Bytes of all files under the store, temp files included (a consistent snapshot)."""
        with self._lock:
            return self._pages.usage_bytes()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop writing and give the root up (idempotent). Reads of indexed pages still work
        (checksummed, so never corrupt); writes return False, and nothing is deleted any more:
        the folder may have a new owner."""
        with self._lock:
            self._closed = True
        self._dir_lock.release()

    def __enter__(self) -> PageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _read_file(self, entry: IndexEntry) -> bytes:
        return read_page(entry.path, entry.key)[1]

    def _path_of(self, key: str) -> Path:
        return self._pages.path_of(key)

    def _count_expiry(self, entry: IndexEntry) -> None:
        self._counts["expired"] += 1
        self._expired_by_group[entry.group] += 1

    def _live(self, entry: IndexEntry, now: float) -> bool:
        if self.policy.is_live(entry.expiry, now) and not entry.doomed:
            return True
        if not entry.doomed:
            self._count_expiry(entry)
            entry.doomed = True
        self._release_if_doomed(entry)
        return False

    def _set_expiry(self, entry: IndexEntry, now: float, expiry: float | None = None) -> None:
        entry.expiry = self.policy.expiry_on_access(entry.group, now) if expiry is None else expiry
        self._expiry.push(entry)

    def _make_room(self, size: int) -> bool:
        """Evict soonest-expiring unpinned pages until `size` more bytes fit (lock held)."""
        if size > self.capacity_bytes:
            return False
        pinned: list[QueuedExpiry] = []
        while self._used + self._reserved + size > self.capacity_bytes:
            item = self._expiry.pop()
            if item is None:
                break
            if item.entry.readers:
                pinned.append(item)
                continue
            self._counts["evicted"] += 1
            item.entry.doomed = True
            self._release_if_doomed(item.entry)
        self._expiry.put_back(pinned)
        return self._used + self._reserved + size <= self.capacity_bytes

    def _release_if_doomed(self, entry: IndexEntry) -> int:
        """Delete a doomed entry's file once nobody reads it (lock held); 1 if deleted."""
        if not entry.doomed or entry.readers or self._entries.get(entry.key) is not entry:
            return 0
        del self._entries[entry.key]
        self._used -= entry.size
        if not self._closed:  # after close the folder may belong to another store
            self._pages.unlink(entry.path)
        return 1

    def _rebuild_index(self) -> None:
        """Index the page files of the folder (see `PageDirectory.found_pages`); one bad file
        never stops a start."""
        pages_dir = self._pages.path
        pages_dir.mkdir(exist_ok=True)
        now = self._clock()
        for found in self._pages.found_pages():
            header = found.header
            entry = IndexEntry(
                header.key, header.group, header.file_len, header.write_time, found.path
            )
            entry.last_access = found.last_access
            self._entries[header.key] = entry
            self._used += entry.size
            self._set_expiry(entry, entry.last_access)
            if not self.policy.is_live(entry.expiry, now):
                self._count_expiry(entry)
                entry.doomed = True
                self._release_if_doomed(entry)
        self._make_room(0)  # capacity may have shrunk since the last run
        try:
            fsync_directory(pages_dir)  # make the removals above durable
        except OSError as error:
            self._counts["io_errors"] += 1
            logger.error("disk store: syncing %s failed: %s", pages_dir, error)
        logger.info("disk store %s: %d pages, %d bytes", self.root, len(self._entries), self._used)
