"""Disk tier: pages with group, size, write time and expiry under a hard byte capacity.

- TTL: expiry comes from the shared `TtlPolicy` (set on write, refreshed on every read).
- Capacity: bytes of page files (header included) never exceed `capacity_bytes`, also while
  writes are in flight: a writer reserves its bytes under the lock before touching the disk.
  (A page overwritten while a reader still has the old file open frees its old bytes only when
  that reader closes it; the accounting counts the files reachable by name.)
  When full, pages are dropped in order of soonest expiry (expired ones first, by construction).
- Crash safety: see `sglang_hicache_ext.tiers.page_file`; on open the index is rebuilt from the files, stray temp
  files and pages that fail the header check are removed (and counted); payload checksums are
  verified on every read, and a corrupt page is dropped instead of served.
- Readers pin an entry: neither expiry nor eviction deletes it until the last reader is done.
- After a restart, a page's expiry is recomputed from its last access (the file's mtime, which
  every read refreshes) and the TTL table of the new process.
- Ownership: one open store per root, in one process at a time (`sglang_hicache_ext.tiers.dir_lock`): opening must
  delete stray temp files, which would otherwise be another store's writes in flight.
- Faults: OS errors never escape `put`/`get`/`touch`/`purge_expired` (False / miss / 0, logged,
  counted); only invalid arguments (an empty key, a negative TTL) raise `ValueError`: those are
  the caller's bugs and are refused before anything is touched.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sglang_hicache_ext.radix.groups import RESIDUAL_GROUP
from sglang_hicache_ext.tiers.dir_lock import DirectoryLock
from sglang_hicache_ext.tiers.page_file import (
    PAGE_SUFFIX,
    TEMP_SUFFIX,
    CorruptPageError,
    PageHeader,
    commit,
    encode_header,
    fsync_directory,
    read_header,
    read_page,
    write_temp,
)
from sglang_hicache_ext.tiers.ttl_policy import TtlPolicy

logger = logging.getLogger(__name__)

STORE_LOCK_NAME = "store.lock"  # in the root, beside `pages/`


@dataclass(frozen=True)
class PageInfo:
    key: str
    group: str
    size_bytes: int  # file bytes, header included
    write_time: float
    last_access: float
    expiry: float


@dataclass(frozen=True)
class DiskStoreStats:
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


class _Entry:
    """Mutable index record; only touched under the store lock."""

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


class DiskStore:
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
        self._entries: dict[str, _Entry] = {}
        self._expiry_heap: list[tuple[float, int, _Entry]] = []  # lazy: stale items skipped
        self._sequence = itertools.count()
        self._used = 0
        self._reserved = 0
        self._counts = dict.fromkeys(
            (
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
            ),
            0,
        )
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
        _check_key(key)
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
                self._unlink(temp)
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
            entry = _Entry(key, group, size, now, path)
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
        _check_key(key)
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
            while self._expiry_heap and self._expiry_heap[0][0] < now:
                expiry, _, entry = heapq.heappop(self._expiry_heap)
                if not self._current(entry, expiry):
                    continue
                self._counts["expired"] += 1
                entry.doomed = True
                removed += self._release_if_doomed(entry)
        return removed

    def stats(self) -> DiskStoreStats:
        with self._lock:
            return DiskStoreStats(
                entries=len(self._entries),
                used_bytes=self._used,
                reserved_bytes=self._reserved,
                capacity_bytes=self.capacity_bytes,
                **self._counts,
            )

    def disk_usage_bytes(self) -> int:
        """Bytes of all files under the store, temp files included (a consistent snapshot)."""
        total = 0
        with self._lock:
            for path in self._files_under(self._pages_dir()):
                # A failed write removes its temp file without the lock: tolerate that race.
                with contextlib.suppress(FileNotFoundError):
                    total += path.stat().st_size
        return total

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

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _read_file(self, entry: _Entry) -> bytes:
        return read_page(entry.path, entry.key)[1]

    def _pages_dir(self) -> Path:
        return self.root / "pages"

    def _path_of(self, key: str) -> Path:
        digest = hashlib.sha256(key.encode()).hexdigest()
        return self._pages_dir() / digest[:2] / (digest + PAGE_SUFFIX)

    def _live(self, entry: _Entry, now: float) -> bool:
        if self.policy.is_live(entry.expiry, now) and not entry.doomed:
            return True
        if not entry.doomed:
            self._counts["expired"] += 1
            entry.doomed = True
        self._release_if_doomed(entry)
        return False

    def _set_expiry(self, entry: _Entry, now: float, expiry: float | None = None) -> None:
        entry.expiry = self.policy.expiry_on_access(entry.group, now) if expiry is None else expiry
        heapq.heappush(self._expiry_heap, (entry.expiry, next(self._sequence), entry))
        if len(self._expiry_heap) > 4 * len(self._entries) + 64:
            self._expiry_heap = [
                (e.expiry, next(self._sequence), e) for e in self._entries.values()
            ]
            heapq.heapify(self._expiry_heap)

    def _current(self, entry: _Entry, expiry: float) -> bool:
        return self._entries.get(entry.key) is entry and entry.expiry == expiry

    def _make_room(self, size: int) -> bool:
        """Evict soonest-expiring unpinned pages until `size` more bytes fit (lock held)."""
        if size > self.capacity_bytes:
            return False
        pinned: list[tuple[float, int, _Entry]] = []
        while self._used + self._reserved + size > self.capacity_bytes and self._expiry_heap:
            item = heapq.heappop(self._expiry_heap)
            entry = item[2]
            if not self._current(entry, item[0]):
                continue
            if entry.readers:
                pinned.append(item)
                continue
            self._counts["evicted"] += 1
            entry.doomed = True
            self._release_if_doomed(entry)
        for item in pinned:
            heapq.heappush(self._expiry_heap, item)
        return self._used + self._reserved + size <= self.capacity_bytes

    def _release_if_doomed(self, entry: _Entry) -> int:
        """Delete a doomed entry's file once nobody reads it (lock held); 1 if deleted."""
        if not entry.doomed or entry.readers or self._entries.get(entry.key) is not entry:
            return 0
        del self._entries[entry.key]
        self._used -= entry.size
        if not self._closed:  # after close the folder may belong to another store
            self._unlink(entry.path)
        return 1

    def _unlink(self, path: Path) -> None:
        """Delete a file; an OS error is logged and counted (the file stays, unindexed)."""
        try:
            path.unlink(missing_ok=True)
        except OSError as error:
            self._counts["io_errors"] += 1
            logger.error("disk store: could not delete %s: %s", path, error)

    def _files_under(self, directory: Path) -> list[Path]:
        """Every file below `directory`, sorted; folders that vanish or cannot be listed are
        logged and counted, not raised (rglob would raise for a folder removed mid-walk)."""

        def unlisted(error: OSError) -> None:
            self._counts["io_errors"] += 1
            logger.error("disk store: cannot list %s: %s", error.filename, error)

        return sorted(
            Path(folder) / name
            for folder, _, names in os.walk(directory, onerror=unlisted)
            for name in names
        )

    def _rebuild_index(self) -> None:
        """Index the files of the folder (we hold its lock, so every temp file is stray).
        Per-file OS errors are counted and the file skipped: one bad file never stops a start."""
        pages_dir = self._pages_dir()
        pages_dir.mkdir(exist_ok=True)
        now = self._clock()
        for path in self._files_under(pages_dir):
            if path.name.endswith(TEMP_SUFFIX):
                self._counts["removed_temp_files"] += 1
                logger.warning("disk store: removing partial write %s", path)
                self._unlink(path)
                continue
            header = self._checked_header(path)
            if header is None:
                continue
            try:
                mtime = path.stat().st_mtime
            except OSError as error:
                self._counts["io_errors"] += 1
                logger.error("disk store: skipping %s: %s", path, error)
                continue
            entry = _Entry(header.key, header.group, header.file_len, header.write_time, path)
            entry.last_access = max(header.write_time, mtime)
            self._entries[header.key] = entry
            self._used += entry.size
            self._set_expiry(entry, entry.last_access)
            if not self.policy.is_live(entry.expiry, now):
                self._counts["expired"] += 1
                entry.doomed = True
                self._release_if_doomed(entry)
        self._make_room(0)  # capacity may have shrunk since the last run
        try:
            fsync_directory(pages_dir)  # make the removals above durable
        except OSError as error:
            self._counts["io_errors"] += 1
            logger.error("disk store: syncing %s failed: %s", pages_dir, error)
        logger.info("disk store %s: %d pages, %d bytes", self.root, len(self._entries), self._used)

    def _checked_header(self, path: Path) -> PageHeader | None:
        try:
            header = read_header(path)
            if self._path_of(header.key) != path:
                raise CorruptPageError(f"{path}: file name does not match key {header.key!r}")
        except (CorruptPageError, OSError) as error:
            self._counts["io_errors" if isinstance(error, OSError) else "corrupt_pages"] += 1
            logger.error("disk store: removing unreadable page file %s: %s", path, error)
            self._unlink(path)
            return None
        return header


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not key:
        raise ValueError(f"page key must be a non-empty string, got {key!r}")
