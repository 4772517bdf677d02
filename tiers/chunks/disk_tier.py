"""Local-disk tier of precomputed chunks: one crash-safe file per chunk, a byte budget, LRU.

A chunk is stored dense, or compressed by a codec (`stored_forms.py`): the budget counts the
bytes on disk, so compressed chunks let the tier hold more, and reading them moves fewer bytes.

Chunks survive a restart: opening the directory indexes every chunk file whose header verifies
(stray temp files of an interrupted write are removed, files that fail their checks are deleted
and counted), so a chunk registered before is found again by its key. Checksums (per row, or per
layer of a compressed chunk) are checked on every read, dense or sparse; a chunk that fails is deleted, counted and reported as missing,
never returned. A write that fails (disk full, I/O error) is logged and counted and leaves the
tier as it was: the caller keeps the chunk in memory only.

The last access time of a chunk is its file's mtime, so the LRU order also survives a restart.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from sglang_hicache_ext.tiers.atomic_write import TEMP_SUFFIX, commit, fsync_directory, write_temp
from sglang_hicache_ext.tiers.chunks.chunk_tensors import ChunkTensors
from sglang_hicache_ext.tiers.chunks.header import ChunkFileHeader, CorruptChunkError
from sglang_hicache_ext.tiers.chunks.host_cache import LruCounts
from sglang_hicache_ext.tiers.chunks.stored_forms import (
    LayerRows,
    StoredBlob,
    load_stored,
    read_header,
    read_layer_rows,
)
from sglang_hicache_ext.tiers.chunks.tier import ChunkTier

logger = logging.getLogger(__name__)

CHUNK_SUFFIX = ".chunk"  # a chunk's file in the tier's directory: `<key>.chunk`, either form


@dataclass(frozen=True)
class ChunkDiskStats(LruCounts):
    write_errors: int
    corrupt_dropped: int
    bytes_read: int
    interrupted_writes: int  # temp files of writes cut short (a crash), removed at open


class _Entry(NamedTuple):
    path: Path
    nbytes: int
    last_access: float


class ChunkReader:
    """One chunk file held open for row reads, layer by layer (a request streaming it).

    The open descriptor keeps the file readable even if the budget evicts it meanwhile."""

    def __init__(self, tier: ChunkDiskTier, key: str, header: ChunkFileHeader, fd: int) -> None:
        self.tier = tier
        self.key = key
        self.header = header
        self._fd = fd
        self._closer = weakref.finalize(self, os.close, fd)

    def read(self, layer: int, rows: Sequence[int] | None) -> LayerRows:
        """`rows` (sorted; None: all) of `layer`, every row verified. CorruptChunkError when
        they fail their checks (the chunk is then dropped from the tier and counted)."""
        return self.tier._read_layer(self, self._fd, layer, rows)

    def close(self) -> None:
        self._closer()


class ChunkDiskTier(ChunkTier[ChunkDiskStats]):
    """Thread-safe directory of chunk files under a byte budget (least recently used evicted).

    `read_bytes_per_s` caps the read rate (benchmarks emulate a slower medium with it)."""

    def __init__(
        self,
        directory: str | Path,
        capacity_bytes: int,
        clock: Callable[[], float] = time.time,
        read_bytes_per_s: float | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"chunk_disk_bytes must be positive, got {capacity_bytes}")
        if read_bytes_per_s is not None and not read_bytes_per_s > 0:
            raise ValueError(f"read_bytes_per_s must be positive, got {read_bytes_per_s}")
        self.read_bytes_per_s = read_bytes_per_s
        self.directory = Path(directory)
        # Told of every chunk that leaves the tier other than by `remove` (evicted by the budget,
        # dropped as corrupt), so an owner can forget chunks no tier holds any more.
        self.on_drop: Callable[[str], None] | None = None
        # How much a chunk is worth keeping (host memory's retention by utility: its expected
        # reuse); the budget evicts the least worth first, the least recently used among equals.
        self.keep_score: Callable[[str], float] | None = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(f"chunk_disk_dir {directory}: cannot create ({error})") from error
        if not os.access(self.directory, os.R_OK | os.W_OK | os.X_OK):
            raise ValueError(f"chunk_disk_dir {directory}: not readable and writable")
        self.capacity_bytes = capacity_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._counts = dict.fromkeys(
            (
                "hits",
                "misses",
                "evictions",
                "write_errors",
                "corrupt_dropped",
                "bytes_read",
                "interrupted_writes",
            ),
            0,
        )
        self._open()

    # -- queries ---------------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def keys_by_recency(self) -> list[str]:
        """Stored keys, least recently used first."""
        with self._lock:
            return [k for k, _ in sorted(self._entries.items(), key=lambda kv: kv[1].last_access)]

    def stats(self) -> ChunkDiskStats:
        with self._lock:
            used = sum(entry.nbytes for entry in self._entries.values())
            return ChunkDiskStats(len(self._entries), used, self.capacity_bytes, **self._counts)

    # -- writes ----------------------------------------------------------------------------

    def put_stored(self, key: str, header: bytes, rows: bytes) -> bool:
        """`put` of a chunk already encoded (`stored_forms.encode_stored`)."""
        size = len(header) + len(rows)
        if size > self.capacity_bytes:
            self._failed_write(key, f"{size} bytes exceed the tier's {self.capacity_bytes}")
            return False
        path = self._path(key)
        now = self._clock()
        try:
            temp = write_temp(path, header, rows, now)
            commit(temp, path)
            fsync_directory(self.directory)
        except OSError as error:
            self._failed_write(key, str(error))
            return False
        with self._lock:
            self._entries[key] = _Entry(path, size, now)
            victims = self._over_budget(keep=key)
        for victim in victims:
            self._delete(victim)
            self._dropped(victim)
        return key in self

    # -- reads -----------------------------------------------------------------------------

    def get(self, key: str) -> ChunkTensors | StoredBlob | None:
        """The whole chunk, every row (or compressed layer) verified; None if absent or corrupt
        (then dropped)."""
        entry = self._touch(key)
        if entry is None:
            return None
        began = time.perf_counter()
        try:
            chunk = load_stored(entry.path.read_bytes(), str(entry.path), expected_key=key)
        except (CorruptChunkError, OSError) as error:
            self._drop_corrupt(key, error)
            return None
        self._add("bytes_read", entry.nbytes)
        self._throttle(entry.nbytes, began)
        return chunk

    def header(self, key: str) -> ChunkFileHeader | None:
        """A chunk's verified header (tokens, geometry, scores) without its rows."""
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            return None
        try:
            return read_header(entry.path)
        except (CorruptChunkError, OSError) as error:
            self._drop_corrupt(key, error)
            return None

    def read_layers(self, key: str, rows: Sequence[int] | None) -> list[LayerRows] | None:
        """`rows` (sorted; None: all) of every layer, verified; None if the chunk is gone or
        corrupt (then dropped). Only those rows are read from the file."""
        reader = self.open_reader(key)
        if reader is None:
            return None
        try:
            return [reader.read(layer, rows) for layer in range(reader.header.num_layers)]
        except CorruptChunkError:
            return None
        finally:
            reader.close()

    def open_reader(self, key: str) -> ChunkReader | None:
        """The chunk held open for streamed row reads; None if absent or corrupt (dropped)."""
        entry = self._touch(key)
        if entry is None:
            return None
        try:
            header = read_header(entry.path)
            if header.key != key:
                raise CorruptChunkError(f"{entry.path}: holds {header.key[:12]}")
            fd = os.open(entry.path, os.O_RDONLY)
        except (CorruptChunkError, OSError) as error:
            self._drop_corrupt(key, error)
            return None
        return ChunkReader(self, key, header, fd)

    def _read_layer(
        self, reader: ChunkReader, fd: int, layer: int, rows: Sequence[int] | None
    ) -> LayerRows:
        began = time.perf_counter()
        try:
            layer_rows = LayerRows(*read_layer_rows(fd, reader.header, layer, rows))
        except (CorruptChunkError, OSError) as error:
            self._drop_corrupt(reader.key, error)
            raise CorruptChunkError(f"chunk {reader.key[:12]} layer {layer}: {error}") from error
        self._add("bytes_read", layer_rows.bytes_read)
        self._throttle(layer_rows.bytes_read, began)
        return layer_rows

    def _throttle(self, nbytes: int, began: float) -> None:
        if self.read_bytes_per_s is not None:  # the rest of the time the medium would take
            time.sleep(max(0.0, nbytes / self.read_bytes_per_s - (time.perf_counter() - began)))

    def remove(self, key: str) -> bool:
        with self._lock:
            if key not in self._entries:
                return False
        self._delete(key)
        return True

    # -- internals -------------------------------------------------------------------------

    def _open(self) -> None:
        for temp in self.directory.glob(f".*{TEMP_SUFFIX}"):
            temp.unlink(missing_ok=True)  # an interrupted write: never committed
            self._counts["interrupted_writes"] += 1
        for path in self.directory.glob(f"*{CHUNK_SUFFIX}"):
            try:
                header = read_header(path)
                if self._path(header.key) != path:
                    raise CorruptChunkError(f"{path}: holds {header.key[:12]}")
            except (CorruptChunkError, OSError) as error:
                self._counts["corrupt_dropped"] += 1
                logger.warning("hicache_ext chunk disk: dropped %s (%s)", path.name, error)
                path.unlink(missing_ok=True)
                continue
            self._entries[header.key] = _Entry(path, header.file_len, path.stat().st_mtime)
        for victim in self._over_budget():
            self._delete(victim)

    def _path(self, key: str) -> Path:
        if not key or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"chunk keys are lowercase hex content hashes, got {key[:40]!r}")
        return self.directory / f"{key}{CHUNK_SUFFIX}"

    def _touch(self, key: str) -> _Entry | None:
        now = self._clock()
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._counts["misses"] += 1
                return None
            self._counts["hits"] += 1
            self._entries[key] = entry._replace(last_access=now)
        with contextlib.suppress(OSError):  # only the LRU order after a restart depends on it
            os.utime(entry.path, (now, now))
        return entry

    def _over_budget(self, keep: str | None = None) -> list[str]:
        """Keys to evict (the least worth keeping, then the least recently used first) to fit
        the budget, never `keep` (the chunk just written: a write that returned True is on
        disk); caller holds the lock."""
        used = sum(entry.nbytes for entry in self._entries.values())
        if used <= self.capacity_bytes:
            return []
        score = self.keep_score or (lambda key: 0.0)
        victims = []
        order = sorted(self._entries.items(), key=lambda kv: (score(kv[0]), kv[1].last_access))
        for key, entry in order:
            if key == keep:
                continue
            if used <= self.capacity_bytes:
                break
            victims.append(key)
            used -= entry.nbytes
            self._counts["evictions"] += 1
        return victims

    def _delete(self, key: str) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
        if entry is not None:
            entry.path.unlink(missing_ok=True)

    def _drop_corrupt(self, key: str, error: Exception) -> None:
        self._add("corrupt_dropped", 1)
        logger.error("hicache_ext chunk disk: chunk %s dropped: %s", key[:12], error)
        self._delete(key)
        self._dropped(key)

    def _dropped(self, key: str) -> None:
        if self.on_drop is not None:
            self.on_drop(key)

    def _failed_write(self, key: str, reason: str) -> None:
        self._add("write_errors", 1)
        logger.error("hicache_ext chunk disk: chunk %s kept in memory only: %s", key[:12], reason)

    def _add(self, name: str, amount: int) -> None:
        with self._lock:
            self._counts[name] += amount
