"""Which chunks the servers sharing a remote store wrote: one catalogue they all append to and read.

Mooncake's store lists no keys, so a chunk one server stores (registered, or kept from traffic by
`auto_chunks`) would be found by another only if that one asked for its exact key, and a
document kept from traffic is cut and labelled by the prompt it came in: its key is not known to
a server that sees it in another prompt. The catalogue makes every stored chunk known to every
server: writers append entries `catalog/<n>` (n = 0, 1, ...), each naming the chunks one put
stored and who stored them; readers read forward from where they stopped and index the chunks'
headers (tokens, sizes) without their rows.

An entry is claimed without a lock: the store's `put` never overwrites (a second put of a key is
accepted and ignored), so a writer puts its entry at the first slot it believes free, reads the
slot back, and, if another writer's entry is there, tries the next slot. A slot that stays empty
while later ones are filled (a writer that died between claiming and writing, or an entry the
store evicted under memory pressure) is skipped after `hole_timeout_s`, logged and counted. A
writer appends only after the last filled slot, so it never fills a gap readers have skipped
(unless it stalled for longer than that timeout between looking and writing).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass

from sglang_hicache_ext.tiers.chunks.mooncake_client import ObjectStoreClient, RemoteStoreError

logger = logging.getLogger(__name__)

_WINDOW = 16  # slots read per round trip
_MAX_CLAIMS = 256  # slots a publish tries before it gives up (counted)
_MAX_FAILURES = 4  # store errors a publish takes before it gives up: the store is unreachable


@dataclass(frozen=True)
class CatalogEntry:
    writer: str
    keys: tuple[str, ...]


@dataclass(frozen=True)
class CatalogStats:
    read: int  # entries read (own ones included)
    published: int  # entries this server appended
    publish_errors: int  # appends that failed (the chunk is in the store, unknown to others)
    holes_skipped: int  # slots given up on (writer died mid-append, or entry evicted)
    lost_races: int  # slots another writer took first


class ChunkCatalog:
    """Append and read the catalogue of one store namespace (thread-safe)."""

    def __init__(
        self, store: ObjectStoreClient, prefix: str, writer: str, hole_timeout_s: float = 5.0
    ) -> None:
        self.store = store
        self.prefix = prefix + "catalog/"
        self.writer = writer
        self.hole_timeout_s = hole_timeout_s
        self._cursor = 0  # next slot to read
        self._next_write = 0  # first slot this writer believes free
        self._hole_since: float | None = None
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def publish(self, keys: list[str]) -> bool:
        """Append an entry naming `keys`; False (logged, counted) if the store refused it."""
        # The nonce makes two writers' entries for the same keys tell apart on read-back.
        body = json.dumps(
            {"writer": self.writer, "keys": keys, "nonce": os.urandom(8).hex()}
        ).encode()
        with self._lock:
            start = max(self._cursor, self._next_write)
        failures: list[str] = []
        try:
            slot = self._end(start)
        except RemoteStoreError as error:
            slot, failures = start, [str(error)] * _MAX_FAILURES
        for _ in range(_MAX_CLAIMS):
            if len(failures) >= _MAX_FAILURES:
                break
            try:
                self.store.put(self._slot(slot), body)
                if self.store.get(self._slot(slot)) == body:
                    with self._lock:
                        self._next_write = slot + 1
                        self._counts["published"] += 1
                    return True
            except RemoteStoreError as error:
                # Also how a put or read of a slot another writer is filling right now fails.
                failures.append(str(error))
            with self._lock:
                self._counts["lost_races"] += 1
            slot += 1
        error = failures[-1] if failures else f"no free slot in {_MAX_CLAIMS} tries"
        logger.error("chunk catalogue: %d chunks not announced: %s", len(keys), error)
        with self._lock:
            self._counts["publish_errors"] += 1
        return False

    def _end(self, slot: int) -> int:
        """The first empty slot from `slot` with no filled one after it: a writer appends only
        there, never into a gap that readers may have skipped already."""
        while True:
            filled = [data is not None for data in self.store.get_many(self._window(slot))]
            if not any(filled):
                return slot
            slot += _WINDOW - filled[::-1].index(True)  # past the window's last filled slot
            if not filled[-1]:
                return slot

    def read_new(self) -> list[CatalogEntry]:
        """Entries appended since the last call, in order (RemoteStoreError if unreachable)."""
        entries: list[CatalogEntry] = []
        with self._lock:
            while True:
                found = self.store.get_many(self._window(self._cursor))
                filled = [data is not None for data in found]
                for data in found:
                    if data is None:
                        break
                    entries.append(_parse(data))
                    self._cursor += 1
                    self._hole_since = None
                else:
                    continue  # the whole window was filled: read on
                if not any(filled[filled.index(False) :]):
                    return entries  # caught up
                # An empty slot with filled ones after it: wait a little, then skip it.
                now = time.monotonic()
                if self._hole_since is None:
                    self._hole_since = now
                if now - self._hole_since < self.hole_timeout_s:
                    return entries
                logger.warning(
                    "chunk catalogue: slot %d empty for %.0f s, skipped",
                    self._cursor,
                    now - self._hole_since,
                )
                self._counts["holes_skipped"] += 1
                self._cursor += 1
                self._hole_since = None

    def stats(self) -> CatalogStats:
        with self._lock:
            read = self._cursor - self._counts["holes_skipped"]
            return CatalogStats(
                read,
                self._counts["published"],
                self._counts["publish_errors"],
                self._counts["holes_skipped"],
                self._counts["lost_races"],
            )

    def _slot(self, n: int) -> str:
        return f"{self.prefix}{n}"

    def _window(self, start: int) -> list[str]:
        return [self._slot(n) for n in range(start, start + _WINDOW)]


def _parse(data: bytes) -> CatalogEntry:
    try:
        body = json.loads(data)
        return CatalogEntry(str(body["writer"]), tuple(str(k) for k in body["keys"]))
    except (ValueError, KeyError, TypeError) as error:
        logger.error("chunk catalogue: an unreadable entry skipped (%s)", error)
        return CatalogEntry("?", ())
