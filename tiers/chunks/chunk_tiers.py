"""Registered chunks across the tiers: host memory, a local disk, a Mooncake Store servers share.

Writes go through: a chunk put in host memory is written to disk at once (when the server
answers a registration, its chunk is on disk and survives a crash). Host memory is an LRU cache
of the disk: a chunk it evicts stays on disk (demoted); one found only on disk is read back,
verified, and put in host memory again (promoted). A chunk is lost only when no tier holds it:
evicted from host memory after its disk write failed, or evicted by the disk's own budget
while not in host memory. The caller drops such chunks from its index (`put` and `pin` return
them).

With `stream` set, a chunk found only on disk is not read whole when a request pins it: the
request gets `stream(reader)`, which reads the rows it needs layer by layer; the chunk is
promoted after the request lets it go, by a background thread (off the request's TTFT).

With a remote tier (Mooncake Store) writes also go there, and a chunk no local tier holds is
fetched whole from it, verified, and promoted to host memory. Other servers' chunks become
known by key (`discover`); a remote read that fails is counted and the chunk reported missing,
so the request computes its tokens.

Thread-safety: each tier locks itself; this class adds no state shared across threads beyond
its counters and lists (guarded by a lock), so the scheduler thread, a listing request and the
promotion thread may call it.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, cast

from sglang_hicache_ext.tiers.chunks.chunk_tensors import ChunkLike, ChunkTensors
from sglang_hicache_ext.tiers.chunks.codecs.base import KVCodec
from sglang_hicache_ext.tiers.chunks.dense_file import check_storable
from sglang_hicache_ext.tiers.chunks.disk_tier import ChunkDiskStats, ChunkDiskTier, ChunkReader
from sglang_hicache_ext.tiers.chunks.header import ChunkFileHeader, ChunkSummary, summary_of_header
from sglang_hicache_ext.tiers.chunks.host_cache import (
    HostCacheFullError,
    HostCacheStats,
    HostChunkCache,
    NotAdmittedError,
    V,
)
from sglang_hicache_ext.tiers.chunks.remote_tier import ChunkRemoteStats, ChunkRemoteTier
from sglang_hicache_ext.tiers.chunks.stored_forms import StoredBlob, blob_of, encode_stored
from sglang_hicache_ext.tiers.chunks.tier import ChunkTier
from sglang_hicache_ext.tiers.short_lived_worker import ShortLivedWorker

logger = logging.getLogger(__name__)

HOST = "host"
DISK = "disk"
MOONCAKE = "mooncake"
TIER_NAMES = (HOST, DISK, MOONCAKE)  # fastest first


class Pinned(NamedTuple):
    """A chunk held for a request (the owner's chunk, or a stream of a disk chunk), and the
    tier it was found in."""

    chunk: Any
    tier: str
    streamed: bool = False  # rows read from the tier as the request needs them


@dataclass(frozen=True)
class TierStats:
    host: HostCacheStats
    disk: ChunkDiskStats | None
    remote: ChunkRemoteStats | None
    lookups: dict[str, int]  # fusion lookups answered per tier, and "miss"
    promotions: int  # chunks read from a lower tier back into host memory
    demotions: int  # chunks evicted from host memory that a lower tier still holds
    lost: int  # chunks no tier holds any more (evicted everywhere, or a failed write)


class ChunkTiers(Generic[V]):
    """Host memory (`HostChunkCache`) in front of the `ChunkTier`s it has: an optional
    `ChunkDiskTier` and an optional `ChunkRemoteTier`."""

    def __init__(
        self,
        host: HostChunkCache[V],
        disk: ChunkDiskTier | None,
        rebuild: Callable[[ChunkTensors | StoredBlob], V],
        summarize: Callable[[V], ChunkSummary],
        stream: Callable[[ChunkReader], Any] | None = None,
        remote: ChunkRemoteTier | None = None,
        promote_on_read: bool = True,
    ) -> None:
        self.host = host
        # False: a chunk read from a lower tier stays there (a placement, not the LRU, decides
        # what host memory holds).
        self.promote_on_read = promote_on_read
        self.disk = disk
        self.remote = remote
        self._rebuild = rebuild  # tiers do not import fusion: the owner turns rows into chunks
        self._summarize = summarize
        self._stream = stream
        # Threads that end: a promotion rebuilds torch tensors beside the forward.
        self._promoter = ShortLivedWorker("chunk-promoter")
        self._promotions: list[Future[None]] = []
        self._lost_later: list[str] = []  # lost by a background promotion, for the next _settle
        self._lock = threading.Lock()
        # Held by a placement's change of host memory and by a promotion's check-and-put, so
        # that a promotion never undoes a placement (`replace_in_host`, `promote`).
        self._host_writes = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._lookups: Counter[str] = Counter()
        # Chunks handed to a request from disk while host memory had no room (all pinned):
        # held by the request only, counted so that `unpin` balances.
        self._loans: Counter[str] = Counter()
        self._dropped_below: list[str] = []
        for lower in self._lower().values():
            lower.on_drop = self._note_drop

    def _lower(self) -> dict[str, ChunkTier[Any]]:
        """The tiers below host memory, by name, fastest first (those configured)."""
        present: dict[str, ChunkTier[Any] | None] = {DISK: self.disk, MOONCAKE: self.remote}
        return {name: tier for name, tier in present.items() if tier is not None}

    @property
    def tiers(self) -> tuple[str, ...]:
        return (HOST, *self._lower())

    def __contains__(self, key: object) -> bool:
        return key in self.host or any(key in lower for lower in self._lower().values())

    def tiers_of(self, key: str) -> list[str]:
        """The tiers holding `key`, fastest first."""
        held = [HOST] if key in self.host else []
        return held + [name for name, lower in self._lower().items() if key in lower]

    def stored_keys(self) -> list[str]:
        """Every stored key: host memory's (least recent first), then those only on disk, then
        those only in the remote tier."""
        keys = [key for key, _ in self.host.items()]
        below = [*(self.disk.keys_by_recency() if self.disk is not None else [])]
        below += self.remote.keys() if self.remote is not None else []
        seen = set(keys)
        return keys + [key for key in dict.fromkeys(below) if key not in seen]

    def summary(self, key: str) -> ChunkSummary | None:
        """Sizes of a stored chunk (from host memory, or the disk header: no rows read)."""
        chunk = self.host.peek(key)
        if chunk is not None:
            return self._summarize(chunk)
        header = self.header(key)
        return None if header is None else summary_of_header(header)

    def header(self, key: str) -> ChunkFileHeader | None:
        header = None if self.disk is None else self.disk.header(key)
        if header is None and self.remote is not None:
            header = self.remote.header(key)
        return header

    def discover(self, key: str) -> ChunkFileHeader | None:
        """The header of a chunk only the remote tier holds (another server registered it)."""
        return None if self.remote is None else self.remote.discover(key)

    def peek(self, key: str) -> V | None:
        """The chunk from host memory, or read from a lower tier without promoting it."""
        chunk = self.host.peek(key)
        if chunk is not None:
            return chunk
        tensors = self._read_below(key)
        return None if tensors is None else self._rebuild(tensors)

    def _read_below(self, key: str) -> ChunkTensors | StoredBlob | None:
        tensors = self.disk.get(key) if self.disk is not None and key in self.disk else None
        if tensors is None and self.remote is not None:
            tensors = self.remote.get(key)
        return tensors

    # -- writes ----------------------------------------------------------------------------

    def put(
        self, key: str, chunk: V, codec: KVCodec | None = None, *, by_frequency: bool = False
    ) -> list[str]:
        """Store `chunk` in every tier, compressed by `codec` if given (then host memory holds
        the compressed bytes too, so every tier gives back the same rows); the keys no tier
        holds any more (drop them from indexes).

        `by_frequency`: a piece kept from traffic, which must win its place in host memory
        (`HostChunkCache.put`); refused (NotAdmittedError), it is written to no tier.
        Raises HostCacheFullError only when no tier took it (host memory pinned full, and no lower
        tier or every lower write failed)."""
        below = False
        encoded: tuple[bytes, bytes] | None = None
        # Host memory alone keeps dense rows as tensors: no file form (a checksum per row).
        if codec is None and self.disk is None and self.remote is None:
            check_storable(cast(ChunkLike, chunk))  # the owner's chunk type has the fields
        else:
            encoded = encode_stored(key, cast(ChunkLike, chunk), codec)  # once for all tiers
            if codec is not None:
                chunk = self._rebuild(blob_of(key, *encoded))
        full: HostCacheFullError | None = None
        try:  # NotAdmittedError propagates: a refused piece is written to no tier
            evicted = self.host.put(key, chunk, by_frequency=by_frequency)
        except NotAdmittedError:
            raise
        except HostCacheFullError as err:  # pinned full: a lower tier may still take it
            evicted, full = [], err
        if encoded is not None:
            for lower in self._lower().values():  # failed writes are logged, counted there
                below = lower.put_stored(key, *encoded) or below
        if full is not None and not below:
            raise full
        return self._settle(evicted)

    def would_admit(self, key: str, nbytes: int) -> bool:
        """Whether a `put(..., by_frequency=True)` of `nbytes` in host memory would be taken now
        (`HostChunkCache.would_admit`)."""
        return self.host.would_admit(key, nbytes)

    def remove(self, key: str) -> bool:
        """Drop `key` from every tier; False while a running request pins it (nothing removed).
        KeyError when no tier holds it."""
        with self._lock:
            if self._loans[key] > 0:
                return False
        if key in self.host:
            if not self.host.remove(key):
                return False
        elif key not in self:
            raise KeyError(key)
        for lower in self._lower().values():  # the shared tier's copy: for every server sharing it
            lower.remove(key)
        return True

    def replace_in_host(self, key: str, chunk: V | None) -> bool:
        """Make host memory hold `chunk` as `key` (a placement's form of it), or not hold `key`
        (None) while a lower tier does. False (nothing changed) while a request pins it, when
        it does not fit in host memory's free bytes (nothing else is evicted for it), or when
        dropping it would lose it."""
        with self._host_writes:  # no promotion between the checks and the change
            if self.host.pinned(key):
                return False
            if chunk is None:
                if key not in self.host:
                    return True
                if self.tiers_of(key) == [HOST]:
                    return False  # the only copy
                if not self.host.remove(key):
                    return False
                self._add("demotions")
                return True
            stats, held = self.host.stats(), self.host.peek(key)
            freed = 0 if held is None else int(held.nbytes)
            if stats.bytes_used - freed + int(chunk.nbytes) > stats.capacity_bytes:
                return False  # nothing is evicted for a placed form
            try:
                self.host.put(key, chunk, evict=False)
            except HostCacheFullError:
                return False
            return True

    # -- reads by requests -----------------------------------------------------------------

    def pin(self, key: str) -> tuple[Pinned | None, list[str]]:
        """Hold `key` for a request (from host memory, else streamed or promoted from disk, else
        fetched from the remote tier), or None if no tier has it (or its copies failed their
        checks, or the remote tier cannot be reached); with the keys no tier holds any more."""
        try:
            chunk = self.host.pin(key)
        except KeyError:
            pass
        else:
            self._count_lookup(HOST)
            return Pinned(chunk, HOST), []
        on_disk = self.disk is not None and key in self.disk
        if self._stream is not None and self.disk is not None and on_disk:
            reader = self.disk.open_reader(key)
            if reader is not None:
                self._count_lookup(DISK)
                with self._lock:
                    self._loans[key] += 1
                return Pinned(self._stream(reader), DISK, streamed=True), self._settle([])
        tier = DISK
        tensors = self.disk.get(key) if self.disk is not None and on_disk else None
        if tensors is None and self.remote is not None:
            tier, tensors = MOONCAKE, self.remote.get(key)
        if tensors is None:
            self._count_lookup("miss")
            return None, self._settle([])
        chunk = self._rebuild(tensors)
        self._count_lookup(tier)
        try:
            if not self.promote_on_read:
                raise HostCacheFullError("not promoted")  # handled alike: a loan
            evicted = self.host.put(key, chunk)
            self.host.pin(key)
            self._add("promotions")
        except HostCacheFullError:  # host memory pinned full (or no promotion): a loan
            evicted = []
            with self._lock:
                self._loans[key] += 1
        return Pinned(chunk, tier), self._settle(evicted)

    def unpin(self, key: str) -> None:
        with self._lock:
            loaned = self._loans[key] > 0
            if loaned:
                self._loans[key] -= 1
        if not loaned:
            self.host.unpin(key)
        elif self._stream is not None and self.promote_on_read:
            self._promote_later(key)

    def promote(self, key: str) -> bool:
        """Read `key` whole from disk into host memory; False if it is there already, gone,
        host memory has no room (its pinned chunks fill it), or promotion was turned off since
        it was queued (a placement decides what host memory holds)."""
        if key in self.host or self.disk is None or not self.promote_on_read:
            return False
        tensors = self.disk.get(key)
        if tensors is None:
            return False
        try:
            with self._host_writes:  # a placement may have started during the read
                if not self.promote_on_read:
                    return False
                # if_absent: a placement may have put its own form of it meanwhile.
                evicted = self.host.put(key, self._rebuild(tensors), if_absent=True)
        except HostCacheFullError:
            return False
        self._add("promotions")
        lost = self._settle(evicted)
        with self._lock:
            self._lost_later.extend(lost)
        return True

    def wait_for_promotions(self) -> None:
        """Block until the promotions queued so far are done (tests, orderly shutdown)."""
        with self._lock:
            pending, self._promotions = self._promotions, []
        for future in pending:
            future.exception()

    def _promote_later(self, key: str) -> None:
        with self._lock:
            self._promotions = [f for f in self._promotions if not f.done()]
            self._promotions.append(self._promoter.submit(self._promote_logged, key))

    def _promote_logged(self, key: str) -> None:
        try:
            self.promote(key)
        except Exception:  # a background thread must not die silently
            logger.exception("chunk %s: promotion to host memory failed", key[:12])

    # -- reporting -------------------------------------------------------------------------

    def stats(self) -> TierStats:
        with self._lock:
            counts = dict(self._counts)
            lookups = {name: self._lookups[name] for name in (*self.tiers, "miss")}
        return TierStats(
            host=self.host.stats(),
            disk=self.disk.stats() if self.disk is not None else None,
            remote=self.remote.stats() if self.remote is not None else None,
            lookups=lookups,
            promotions=counts.get("promotions", 0),
            demotions=counts.get("demotions", 0),
            lost=counts.get("lost", 0),
        )

    # -- internals -------------------------------------------------------------------------

    def _note_drop(self, key: str) -> None:
        with self._lock:
            self._dropped_below.append(key)

    def _settle(self, evicted_from_host: list[str]) -> list[str]:
        """Count host evictions that a lower tier still holds as demotions; the keys no tier
        holds now (host evictions without a lower copy, lower evictions and drops not in host
        memory)."""
        with self._lock:
            dropped, self._dropped_below = self._dropped_below, []
            later, self._lost_later = self._lost_later, []
        demoted = [key for key in evicted_from_host if key in self]
        lost = list(dict.fromkeys(k for k in (*evicted_from_host, *dropped) if k not in self))
        self._add("demotions", len(demoted))
        self._add("lost", len(lost))
        # Lost by a background promotion (counted then): the owner hears of them now.
        return lost + [k for k in dict.fromkeys(later) if k not in lost and k not in self]

    def _count_lookup(self, tier: str) -> None:
        with self._lock:
            self._lookups[tier] += 1

    def _add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] += amount
