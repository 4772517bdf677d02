"""Chunk store v1: byte capacity, LRU, pins, idempotent keys, no loss on a failed put."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import pytest
import torch

from sglang_hicache_ext.tiers.chunks.host_cache import HostCacheFullError, HostChunkCache


@dataclass(frozen=True)
class Blob:
    nbytes: int


def test_lru_eviction_by_bytes() -> None:
    store: HostChunkCache[Blob] = HostChunkCache(capacity_bytes=100)
    store.put("a", Blob(40))
    store.put("b", Blob(40))
    assert store.get("a") is not None  # a is now the most recent
    assert store.put("c", Blob(40)) == ["b"]
    assert "a" in store and "c" in store and "b" not in store
    stats = store.stats()
    assert (stats.bytes_used, stats.entries, stats.evictions, stats.hits) == (80, 2, 1, 1)


def test_pinned_entries_survive_and_full_store_refuses() -> None:
    store: HostChunkCache[Blob] = HostChunkCache(capacity_bytes=100)
    store.put("a", Blob(60))
    store.pin("a")
    with pytest.raises(HostCacheFullError, match="pinned by running requests"):
        store.put("b", Blob(60))
    assert store.remove("a") is False
    store.unpin("a")
    assert store.put("b", Blob(60)) == ["a"]
    with pytest.raises(HostCacheFullError, match="the store holds 100"):
        store.put("huge", Blob(101))


def test_puts_that_must_not_evict_or_replace() -> None:
    store: HostChunkCache[Blob] = HostChunkCache(capacity_bytes=100)
    store.put("a", Blob(60))
    with pytest.raises(HostCacheFullError):
        store.put("b", Blob(60), evict=False)  # would need a's room
    assert "a" in store and "b" not in store and store.stats().evictions == 0
    assert store.put("a", Blob(10), if_absent=True) == []
    assert store.peek("a") == Blob(60)  # left as it was
    store.put("a", Blob(30), evict=False)  # a replace counts the old value's room as free
    assert store.peek("a") == Blob(30) and store.stats().bytes_used == 30
    store.pin("a")
    assert store.pinned("a") and not store.pinned("b")


def test_failed_replace_keeps_the_old_value() -> None:
    store: HostChunkCache[Blob] = HostChunkCache(capacity_bytes=100)
    store.put("a", Blob(30))
    store.put("b", Blob(60))
    store.pin("b")
    with pytest.raises(HostCacheFullError):
        store.put("a", Blob(50))
    assert store.get("a") == Blob(30)
    assert store.stats().bytes_used == 90


def test_recency_order_skips_pins_and_a_refused_put_counts_its_evictions() -> None:
    store: HostChunkCache[Blob] = HostChunkCache(capacity_bytes=100)
    for key in "abcd":
        store.put(key, Blob(20))
    store.pin("a")  # a lookup: a becomes the most recent
    assert store.get("b") is not None and store.peek("c") is not None  # peek leaves c's place
    assert [key for key, _ in store.items()] == ["c", "d", "a", "b"]
    assert store.put("e", Blob(40)) == ["c"]  # the least recent unpinned entries go first
    assert [key for key, _ in store.items()] == ["d", "a", "b", "e"]
    store.pin("b")
    store.pin("e")
    with pytest.raises(HostCacheFullError, match="pinned by running requests"):
        store.put("f", Blob(70))  # d is evicted, then a, b and e are all pinned
    assert [key for key, _ in store.items()] == ["a", "b", "e"]
    stats = store.stats()
    assert (stats.evictions, stats.rejected, stats.bytes_used) == (2, 1, 80)


def test_unpin_without_pin_and_unknown_remove() -> None:
    store: HostChunkCache[Blob] = HostChunkCache(capacity_bytes=10)
    store.put("a", Blob(1))
    with pytest.raises(ValueError, match="not pinned"):
        store.unpin("a")
    with pytest.raises(KeyError):
        store.remove("zzz")
    with pytest.raises(ValueError, match="positive"):
        HostChunkCache(0)


def test_capacity_never_exceeded_under_concurrent_puts() -> None:
    store: HostChunkCache[Blob] = HostChunkCache(capacity_bytes=1000)
    peaks: list[int] = []

    def writer(worker: int) -> None:
        for i in range(300):
            with contextlib.suppress(HostCacheFullError):
                store.put(f"{worker}-{i}", Blob(17 + (i * worker) % 90))
            peaks.append(store.stats().bytes_used)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(peaks) <= 1000


def test_precomputed_chunk_sizes_itself(tiny_llama_path) -> None:
    from sglang_hicache_ext.fusion import PrecomputedChunk

    n, layers = 12, 3
    keys = tuple(torch.zeros(n, 2, 16) for _ in range(layers))
    chunk = PrecomputedChunk(
        token_ids=tuple(range(n)),
        keys=keys,
        values=keys,
        freq_scores=torch.zeros(layers, n),
        alpha=0.5,
    )
    assert chunk.nbytes == 2 * layers * n * 2 * 16 * 4 + layers * n * 4
    store: HostChunkCache[PrecomputedChunk] = HostChunkCache(capacity_bytes=chunk.nbytes)
    store.put(chunk.content_hash, chunk)
    assert store.get(chunk.content_hash) is chunk
    assert store.peek(chunk.content_hash) is chunk and store.stats().hits == 1  # peek is not a hit


def test_pins_count_as_lookups() -> None:
    # Fusion plans read chunks by pinning them: GET /chunks' hit ratio must see those reads.
    store: HostChunkCache[Blob] = HostChunkCache(capacity_bytes=100)
    store.put("a", Blob(10))
    store.pin("a")
    with pytest.raises(KeyError):
        store.pin("gone")
    assert store.get("a") is not None
    stats = store.stats()
    assert (stats.hits, stats.misses) == (2, 1)
