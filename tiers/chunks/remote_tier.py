"""Shared tier of precomputed chunks in a remote object store (Mooncake Store), for many servers.

A chunk is two objects under `hicache_ext/<namespace>/<key>`: the encoded chunk (either form of
`stored_forms.py`, as on disk: header, then checksummed rows or layers), and its header alone
(`.header`) so that another server can index the chunk, by its tokens, without fetching the rows.
The data object is written first: a header seen by a reader always has its rows written before it.

A server knows the chunks it wrote and those it discovered: by key (`discover`, on a
registration of the same tokens), or through the namespace's catalogue (`remote_catalog.py`),
to which every write is announced and which `announced` reads. Every read is verified (a chunk
that fails is removed, counted, and reported missing); a store that cannot be reached is logged and counted,
and the caller computes the chunk's tokens instead; for `retry_after_s` after such a failure the
store is not asked again (a stopped master costs each request seconds of timeouts otherwise),
and those skipped reads and writes are counted as failures too. A chunk the store no longer holds (evicted
by its own memory pressure, or its owner's segment gone) is forgotten and reported through
`on_drop`.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from sglang_hicache_ext.tiers.chunks.chunk_tensors import ChunkTensors
from sglang_hicache_ext.tiers.chunks.header import ChunkFileHeader, CorruptChunkError
from sglang_hicache_ext.tiers.chunks.mooncake_client import ObjectStoreClient, RemoteStoreError
from sglang_hicache_ext.tiers.chunks.remote_catalog import CatalogStats, ChunkCatalog
from sglang_hicache_ext.tiers.chunks.stored_forms import (
    StoredBlob,
    load_stored,
    parse_stored_header,
)
from sglang_hicache_ext.tiers.chunks.tier import ChunkTier

logger = logging.getLogger(__name__)

HEADER_SUFFIX = ".header"
_HEADER_BATCH = 64  # headers fetched per round trip when learning announced chunks


@dataclass(frozen=True)
class ChunkRemoteStats:
    entries: int  # chunks this server knows the store holds
    bytes_known: int  # their encoded size
    hits: int
    misses: int
    discovered: int  # chunks another server wrote, found by key
    write_errors: int  # puts the store refused or could not take (chunk kept locally only)
    read_errors: int  # reads that failed (store unreachable): the tokens were computed
    corrupt_dropped: int  # objects that failed their checks, removed and never used
    bytes_read: int
    bytes_written: int
    read_s: float  # time spent fetching and verifying
    catalog: CatalogStats | None = None  # None: this server neither announces nor reads
    namespace: str = ""  # where this process's chunks live (a rank's own under --tp-size N)


class ChunkRemoteTier(ChunkTier[ChunkRemoteStats]):
    """Chunks in a store shared with other servers, through its client (thread-safe)."""

    def __init__(
        self,
        store: ObjectStoreClient,
        namespace: str,
        retry_after_s: float = 5.0,
        writer: str | None = None,
        poll_s: float = 0.1,
    ) -> None:
        self.store = store
        self.namespace = namespace
        self.prefix = f"hicache_ext/{namespace}/"
        # With a writer name, writes are announced to the other servers and theirs are read.
        self.catalog = None if writer is None else ChunkCatalog(store, self.prefix, writer)
        self.writer_of: dict[str, str] = {}  # chunk -> the server that announced it
        # The catalogue is read before every request's chunk lookup, at most this often: a
        # round trip per look, and a document another server kept is seen within this time.
        self.poll_s = poll_s
        self._polled_at = -float("inf")
        self._announced: list[tuple[str, str]] = []  # (chunk, writer) read, header not yet
        self.retry_after_s = retry_after_s
        self._unreachable_until = 0.0  # monotonic time before which the store is not asked
        self._headers: dict[str, ChunkFileHeader] = {}  # known chunks, in order learned
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._read_s = 0.0
        self.on_drop: Callable[[str], None] | None = None

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._headers

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._headers)

    def header(self, key: str) -> ChunkFileHeader | None:
        with self._lock:
            return self._headers.get(key)

    def stats(self) -> ChunkRemoteStats:
        with self._lock:
            size = sum(h.stored_bytes for h in self._headers.values())
            counts = {name: self._counts[name] for name in _COUNTERS}
        catalog = None if self.catalog is None else self.catalog.stats()
        return ChunkRemoteStats(
            len(self._headers),
            size,
            read_s=self._read_s,
            catalog=catalog,
            namespace=self.namespace,
            **counts,
        )

    # -- writes ----------------------------------------------------------------------------

    def put_stored(self, key: str, header: bytes, rows: bytes) -> bool:
        """`put` of a chunk already encoded (`stored_forms.encode_stored`)."""
        try:
            self._check_reachable()
            self.store.put(self.prefix + key, header + rows)
            self.store.put(self.prefix + key + HEADER_SUFFIX, header)
        except RemoteStoreError as error:
            logger.error("chunk %s not written to the shared tier: %s", key[:12], error)
            self._failed("write_errors", error)
            return False
        parsed = parse_stored_header(io.BytesIO(header), key, rows_follow=False)
        with self._lock:
            self._headers[key] = parsed
            self._counts["bytes_written"] += len(header) + len(rows)
        if self.catalog is not None:
            self.catalog.publish([key])  # a failure is logged, counted; the chunk stays stored
        return True

    def remove(self, key: str) -> bool:
        """Remove `key` from the store (for every server); False if the store cannot be reached."""
        with self._lock:
            self._headers.pop(key, None)
        try:
            self.store.remove(self.prefix + key + HEADER_SUFFIX)
            self.store.remove(self.prefix + key)
        except RemoteStoreError as error:
            logger.error("chunk %s not removed from the shared tier: %s", key[:12], error)
            return False
        return True

    # -- reads -----------------------------------------------------------------------------

    def discover(self, key: str) -> ChunkFileHeader | None:
        """The header of a chunk another server stored under `key`, now known here; None if
        the store has none (or cannot be reached: logged, counted)."""
        known = self.header(key)
        if known is not None:
            return known
        try:
            self._check_reachable()
            data = self.store.get(self.prefix + key + HEADER_SUFFIX)
        except RemoteStoreError as error:
            logger.warning("chunk %s: shared tier not reachable: %s", key[:12], error)
            self._failed("read_errors", error)
            return None
        return None if data is None else self._learn(key, data)

    def _learn(self, key: str, data: bytes) -> ChunkFileHeader | None:
        """Know `key` from its header object's bytes; None (dropped, counted) if corrupt."""
        try:
            header = parse_stored_header(io.BytesIO(data), key, rows_follow=False)
            if header.key != key:
                raise CorruptChunkError(f"holds {header.key[:12]}")
        except CorruptChunkError as error:
            self._drop_corrupt(key, error)
            return None
        with self._lock:
            self._headers[key] = header
            self._counts["discovered"] += 1
        return header

    def announced(self) -> list[tuple[str, ChunkFileHeader]]:
        """Chunks other servers announced since the last call, with their headers (rows not
        read; headers fetched in batches); [] without a catalogue or within `poll_s` of the
        last look. A store that cannot be reached is logged and counted, and what was read of
        the catalogue but not yet looked up is looked up next time."""
        now = time.monotonic()
        if self.catalog is None or now - self._polled_at < self.poll_s:
            return []
        self._polled_at = now
        found: list[tuple[str, ChunkFileHeader]] = []
        try:
            self._check_reachable()
            for entry in self.catalog.read_new():
                self._announced.extend((key, entry.writer) for key in entry.keys if key not in self)
            while self._announced:
                batch = self._announced[:_HEADER_BATCH]
                names = [self.prefix + key + HEADER_SUFFIX for key, _ in batch]
                for (key, writer), data in zip(batch, self.store.get_many(names), strict=True):
                    if data is None:  # removed since, or a failed read: `get` raises on that
                        data = self.store.get(self.prefix + key + HEADER_SUFFIX)
                    header = None if data is None else self._learn(key, data)
                    if header is not None:
                        self.writer_of[key] = writer
                        found.append((key, header))
                    self._announced.pop(0)
        except RemoteStoreError as error:
            logger.warning("shared tier's catalogue not read: %s", error)
            self._failed("read_errors", error)
        return found

    def get(self, key: str) -> ChunkTensors | StoredBlob | None:
        """The whole chunk, every row (or compressed layer) verified; None if absent,
        unreachable or corrupt."""
        if key not in self:
            return None
        began = time.perf_counter()
        try:
            self._check_reachable()
            data = self.store.get(self.prefix + key)
        except RemoteStoreError as error:
            logger.warning("chunk %s: shared tier read failed, computing it: %s", key[:12], error)
            self._failed("read_errors", error)
            return None
        if data is None:
            self._add("misses")
            self._forget(key)
            return None
        try:
            chunk = load_stored(data, key, expected_key=key)
        except CorruptChunkError as error:
            self._drop_corrupt(key, error)
            return None
        with self._lock:
            self._counts["hits"] += 1
            self._counts["bytes_read"] += len(data)
            self._read_s += time.perf_counter() - began
        return chunk

    # -- internals -------------------------------------------------------------------------

    def _check_reachable(self) -> None:
        with self._lock:
            waiting = self._unreachable_until - time.monotonic()
        if waiting > 0:
            raise _Skipped(f"not asked: the store failed, retried in {waiting:.1f} s")

    def _failed(self, counter: str, error: RemoteStoreError) -> None:
        with self._lock:
            self._counts[counter] += 1
            if not isinstance(error, _Skipped):
                self._unreachable_until = time.monotonic() + self.retry_after_s

    def _drop_corrupt(self, key: str, error: Exception) -> None:
        logger.error("chunk %s in the shared tier fails its checks, removed: %s", key[:12], error)
        self._add("corrupt_dropped")
        self.remove(key)
        self._forget(key)

    def _forget(self, key: str) -> None:
        with self._lock:
            self._headers.pop(key, None)
        if self.on_drop is not None:
            self.on_drop(key)

    def _add(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1


class _Skipped(RemoteStoreError):
    """A request not sent: the store failed less than `retry_after_s` ago."""


_COUNTERS = (
    "hits",
    "misses",
    "discovered",
    "write_errors",
    "read_errors",
    "corrupt_dropped",
    "bytes_read",
    "bytes_written",
)
