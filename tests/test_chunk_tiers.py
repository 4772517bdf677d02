"""Chunks across host memory and the disk tier: write-through, demotion, promotion, losses,
faults, restart (the registry the server uses, on a real directory)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from sglang_hicache_ext.fusion.chunk import PrecomputedChunk
from sglang_hicache_ext.fusion.request import ChunkSegment
from sglang_hicache_ext.fusion.rope import RopeSpec
from sglang_hicache_ext.sglang_ext.chunk_fusion.chunk_listing import describe_chunk, list_chunks
from sglang_hicache_ext.sglang_ext.chunk_fusion.chunk_matches import pinned_chunk_segments
from sglang_hicache_ext.sglang_ext.chunk_fusion.registry import ChunkRegistry
from sglang_hicache_ext.sglang_ext.chunk_fusion.streamed_chunk import StreamedChunk
from sglang_hicache_ext.tiers.chunks import disk_tier
from sglang_hicache_ext.tiers.chunks.chunk_tiers import ChunkTiers
from sglang_hicache_ext.tiers.chunks.disk_tier import ChunkDiskTier
from sglang_hicache_ext.tiers.chunks.header import ChunkSummary
from sglang_hicache_ext.tiers.chunks.host_cache import HostCacheFullError, HostChunkCache
from sglang_hicache_ext.tiers.chunks.tier import chunk_namespace
from tests.test_chunk_disk import make_chunk

ROPE = RopeSpec(inv_freq=torch.ones(8))
CHUNK_BYTES = make_chunk(0).nbytes


def _tiers(
    tmp_path: Path, host_chunks: int, disk_chunks: int = 100
) -> ChunkTiers[PrecomputedChunk]:
    disk = ChunkDiskTier(tmp_path, disk_chunks * (CHUNK_BYTES + 4096))
    return ChunkTiers(
        HostChunkCache(host_chunks * CHUNK_BYTES),
        disk,
        lambda tensors: PrecomputedChunk(*tensors),
        lambda chunk: ChunkSummary(chunk.num_tokens, chunk.num_layers, chunk.nbytes),
    )


def _same(a: PrecomputedChunk, b: PrecomputedChunk) -> bool:
    tensors = zip(
        (*a.keys, *a.values, a.freq_scores), (*b.keys, *b.values, b.freq_scores), strict=True
    )
    return a.token_ids == b.token_ids and all(torch.equal(x, y) for x, y in tensors)


def _fail_writes(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    def failing_write(*args: object, **kwargs: object) -> Path:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(disk_tier, "write_temp", failing_write)


def test_put_writes_through_and_host_evictions_are_demoted(tmp_path: Path) -> None:
    store = _tiers(tmp_path, host_chunks=2)
    chunks = [make_chunk(seed) for seed in range(3)]
    for chunk in chunks:
        assert store.put(chunk.content_hash, chunk) == []  # nothing lost
    first = chunks[0].content_hash
    assert store.tiers_of(first) == ["disk"]  # evicted from host memory, still on disk
    assert store.tiers_of(chunks[2].content_hash) == ["host", "disk"]
    stats = store.stats()
    assert (stats.demotions, stats.lost, stats.host.entries, stats.disk.entries) == (1, 0, 2, 3)
    assert store.stored_keys()[-1] == first  # host memory's chunks first, then disk-only ones
    assert store.summary(first) == ChunkSummary(48, 3, CHUNK_BYTES)  # from the header alone


def test_a_chunk_read_from_disk_is_promoted_exactly(tmp_path: Path) -> None:
    store = _tiers(tmp_path, host_chunks=2)
    chunks = [make_chunk(seed) for seed in range(3)]
    for chunk in chunks:
        store.put(chunk.content_hash, chunk)
    first = chunks[0].content_hash
    pinned, lost = store.pin(first)
    assert pinned is not None and pinned.tier == "disk" and lost == []
    assert _same(pinned.chunk, chunks[0])
    assert store.tiers_of(first) == ["host", "disk"]  # promoted, and pinned there
    again, _ = store.pin(first)
    assert again is not None and again.tier == "host"
    stats = store.stats()
    assert stats.promotions == 1 and stats.lookups == {"host": 1, "disk": 1, "miss": 0}
    assert store.tiers_of(chunks[1].content_hash) == ["disk"]  # made room: demoted
    store.unpin(first)
    store.unpin(first)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_failed_disk_write_keeps_the_chunk_in_host_memory_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    store = _tiers(tmp_path, host_chunks=2)
    kept, failed = make_chunk(1), make_chunk(2)
    store.put(kept.content_hash, kept)
    _fail_writes(monkeypatch, code)
    assert store.put(failed.content_hash, failed) == []
    assert store.tiers_of(failed.content_hash) == ["host"]
    assert store.stats().disk.write_errors == 1
    monkeypatch.undo()
    # Evicted from host memory with no disk copy: lost, and reported so the index forgets it.
    for seed in (3, 4):
        chunk = make_chunk(seed)
        lost = store.put(chunk.content_hash, chunk)
        assert lost == ([failed.content_hash] if seed == 4 else [])
    assert failed.content_hash not in store and store.stats().lost == 1
    assert store.tiers_of(kept.content_hash) == ["disk"]  # demoted, not lost


def test_disk_evictions_of_disk_only_chunks_are_reported_lost(tmp_path: Path) -> None:
    store = _tiers(tmp_path, host_chunks=1, disk_chunks=2)
    chunks = [make_chunk(seed) for seed in range(3)]
    lost = [store.put(chunk.content_hash, chunk) for chunk in chunks]
    assert lost == [[], [], [chunks[0].content_hash]]  # LRU on disk, not in host memory
    assert store.stats().lost == 1 and chunks[0].content_hash not in store


def test_a_corrupt_disk_copy_is_never_served(tmp_path: Path) -> None:
    store = _tiers(tmp_path, host_chunks=1)
    first, second = make_chunk(1), make_chunk(2)
    store.put(first.content_hash, first)
    store.put(second.content_hash, second)  # first now only on disk
    path = tmp_path / f"{first.content_hash}.chunk"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # one bit of one V row of the last layer
    path.write_bytes(bytes(data))
    pinned, lost = store.pin(first.content_hash)
    assert pinned is None and lost == [first.content_hash]
    stats = store.stats()
    assert stats.disk.corrupt_dropped == 1 and stats.lookups["miss"] == 1
    assert not path.exists()


def test_host_memory_pinned_full_still_serves_and_stores_via_disk(tmp_path: Path) -> None:
    store = _tiers(tmp_path, host_chunks=1)
    first, second = make_chunk(1), make_chunk(2)
    store.put(first.content_hash, first)
    store.pin(first.content_hash)
    # Host memory is pinned full: the registration still lands on disk.
    assert store.put(second.content_hash, second) == []
    assert store.tiers_of(second.content_hash) == ["disk"]
    loaned, _ = store.pin(second.content_hash)  # no room to promote: the request holds it
    assert loaned is not None and loaned.tier == "disk" and _same(loaned.chunk, second)
    assert store.remove(second.content_hash) is False  # in use
    store.unpin(second.content_hash)
    assert store.remove(second.content_hash) is True and second.content_hash not in store
    store.unpin(first.content_hash)
    with pytest.raises(KeyError):
        store.remove(second.content_hash)


def test_without_a_disk_a_full_host_memory_refuses(tmp_path: Path) -> None:
    store: ChunkTiers[PrecomputedChunk] = ChunkTiers(
        HostChunkCache(CHUNK_BYTES),
        None,
        lambda t: PrecomputedChunk(*t),
        lambda c: None,  # type: ignore[arg-type,return-value]
    )
    first, second = make_chunk(1), make_chunk(2)
    store.put(first.content_hash, first)
    store.pin(first.content_hash)
    with pytest.raises(HostCacheFullError):
        store.put(second.content_hash, second)
    assert store.tiers == ("host",) and store.stats().disk is None


def test_registry_finds_its_chunks_after_a_restart(tmp_path: Path) -> None:
    chunks = [make_chunk(seed, tokens=64) for seed in range(3)]
    registry = ChunkRegistry(10 * CHUNK_BYTES, ROPE, disk=ChunkDiskTier(tmp_path, 10**8))
    for chunk in chunks:
        assert registry.add(chunk)
    prompt = [7, 7, *chunks[2].token_ids, 9, *chunks[0].token_ids, 9]
    before = pinned_chunk_segments(registry, prompt)
    assert before.tiers == {"host": 2}
    for chunk_id in before.pinned:
        registry.unpin(chunk_id)

    restarted = ChunkRegistry(10 * CHUNK_BYTES, ROPE, disk=ChunkDiskTier(tmp_path, 10**8))
    assert restarted.restored == 3 and len(restarted.index) == 3
    listing = {info["id"]: info for info in list_chunks(restarted)}
    assert {info["tier"] for info in listing.values()} == {"disk"}
    assert listing[chunks[1].content_hash]["nbytes"] == chunks[1].nbytes
    after = pinned_chunk_segments(restarted, prompt)
    assert after.pinned == before.pinned and after.tiers == {"disk": 2}
    assert after.tokens_by_tier == {"disk": 128}
    # Streamed: only the rows asked for are read (verified), nothing is in host memory yet.
    streamed = [seg.chunk for seg in after.segments if isinstance(seg, ChunkSegment)]
    rows = torch.tensor([0, 5, 63])
    for stream, chunk in zip(streamed, (chunks[2], chunks[0]), strict=True):
        assert isinstance(stream, StreamedChunk) and not stream.in_memory
        for layer in range(chunk.num_layers):
            keys, values = stream.rows(layer, rows)
            assert torch.equal(keys, chunk.keys[layer][rows])
            assert torch.equal(values, chunk.values[layer][rows])
        assert stream.stats.bytes_read == 3 * stream.dense_bytes // 64
    assert not any(chunk_id in restarted.store.host for chunk_id in after.pinned)
    # Let go by the request: promoted in the background, exactly the stored KV.
    for chunk_id in after.pinned:
        restarted.unpin(chunk_id)
    restarted.store.wait_for_promotions()
    for chunk_id, chunk in zip(after.pinned, (chunks[2], chunks[0]), strict=True):
        held = restarted.store.host.peek(chunk_id)
        assert held is not None and _same(held, chunk)
    stats = restarted.stats()
    assert stats["hits_by_tier"] == {"host": 0, "disk": 2, "miss": 0}
    assert stats["restored_from_disk"] == 3 and stats["promotions"] == 2
    assert describe_chunk(restarted, chunks[2].content_hash)["tiers"] == ["host", "disk"]
    assert (
        restarted.delete(chunks[2].content_hash) and chunks[2].content_hash not in restarted.index
    )
    assert not (tmp_path / f"{chunks[2].content_hash}.chunk").exists()


def test_registry_forgets_chunks_no_tier_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = ChunkRegistry(CHUNK_BYTES, ROPE, disk=ChunkDiskTier(tmp_path, 10**8))
    first, second = make_chunk(1), make_chunk(2)
    _fail_writes(monkeypatch, errno.ENOSPC)
    assert registry.add(first)  # host memory only
    monkeypatch.undo()
    assert registry.add(second)  # evicts `first`, which no tier holds then
    assert (
        first.content_hash not in registry.index
        and describe_chunk(registry, first.content_hash) is None
    )
    assert registry.stats()["lost"] == 1 and registry.stats()["disk"]["write_errors"] == 1


def test_models_get_their_own_chunk_directories() -> None:
    base = chunk_namespace("/models/Qwen2.5-0.5B", "config-a")
    assert base == chunk_namespace("/models/Qwen2.5-0.5B", "config-a")
    assert base.startswith("Qwen2.5-0.5B-")
    assert base != chunk_namespace("/models/Qwen2.5-0.5B", "config-b")  # other dtype, config
    assert base != chunk_namespace("/other/Qwen2.5-0.5B", "config-a")  # other weights


@pytest.mark.parametrize("streamed", [False, True])
def test_without_promotion_reads_leave_host_memory_as_placed(
    tmp_path: Path, streamed: bool
) -> None:
    store = ChunkTiers(
        HostChunkCache(CHUNK_BYTES),
        ChunkDiskTier(tmp_path, 100 * (CHUNK_BYTES + 4096)),
        lambda tensors: PrecomputedChunk(*tensors),
        lambda chunk: ChunkSummary(chunk.num_tokens, chunk.num_layers, chunk.nbytes),
        stream=StreamedChunk if streamed else None,
        promote_on_read=False,
    )
    placed_below, placed_in_host = make_chunk(1), make_chunk(2)
    for chunk in (placed_below, placed_in_host):
        store.put(chunk.content_hash, chunk)
    key = placed_below.content_hash
    for _ in range(3):
        pinned, lost = store.pin(key)
        assert pinned is not None and pinned.tier == "disk" and lost == []
        assert pinned.streamed == streamed and _same(_whole(pinned.chunk), placed_below)
        store.unpin(key)
        store.wait_for_promotions()
    assert store.tiers_of(key) == ["disk"]
    assert store.tiers_of(placed_in_host.content_hash) == ["host", "disk"]
    assert store.stats().promotions == 0 and store.stats().lookups["disk"] == 3
    # A promotion queued before a placement turned promotion off stands down when it runs.
    assert store.promote(key) is False and store.tiers_of(key) == ["disk"]


def _whole(chunk: object) -> PrecomputedChunk:
    if isinstance(chunk, PrecomputedChunk):
        return chunk
    every = torch.arange(chunk.num_tokens)  # type: ignore[attr-defined]
    rows = [chunk.rows(layer, every) for layer in range(chunk.num_layers)]  # type: ignore[attr-defined]
    return PrecomputedChunk(
        chunk.token_ids,  # type: ignore[attr-defined]
        tuple(k for k, _ in rows),
        tuple(v for _, v in rows),
        chunk.freq_scores,  # type: ignore[attr-defined]
        chunk.alpha,  # type: ignore[attr-defined]
    )
