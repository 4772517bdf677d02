"""The local-disk chunk tier: exact round trips, sparse row reads, checksums, budget, restarts,
injected write faults, and writers killed mid-write."""

from __future__ import annotations

import errno
import multiprocessing
import os
import random
import signal
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch

from sglang_hicache_ext.fusion.chunk import PrecomputedChunk
from sglang_hicache_ext.tiers.chunks import disk_tier
from sglang_hicache_ext.tiers.chunks.chunk_tensors import ChunkTensors
from sglang_hicache_ext.tiers.chunks.disk_tier import ChunkDiskTier
from sglang_hicache_ext.tiers.chunks.header import ChunkFileHeader


def make_chunk(
    seed: int, tokens: int = 48, layers: int = 3, dtype=torch.float32
) -> PrecomputedChunk:
    generator = torch.Generator().manual_seed(seed)
    shape = (tokens, 2, 16)

    def tensor() -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(dtype)

    return PrecomputedChunk(
        token_ids=tuple(int(t) for t in torch.randint(0, 50_000, (tokens,), generator=generator)),
        keys=tuple(tensor() for _ in range(layers)),
        values=tuple(tensor() for _ in range(layers)),
        freq_scores=torch.rand((layers, tokens), generator=generator),
        alpha=0.25,
    )


def assert_same(stored: ChunkTensors, b: PrecomputedChunk) -> None:
    a = PrecomputedChunk(*stored)  # the fusion core's type rebuilds from what storage returns
    assert a.token_ids == b.token_ids and a.alpha == b.alpha
    assert torch.equal(a.freq_scores, b.freq_scores)
    for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values), strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)


def _stored_chunk(
    tmp_path: Path, seed: int
) -> tuple[ChunkDiskTier, PrecomputedChunk, ChunkFileHeader]:
    """A tier in `tmp_path` holding `make_chunk(seed)`, and the header it stored for it."""
    tier = ChunkDiskTier(tmp_path, 10**8)
    chunk = make_chunk(seed)
    tier.put(chunk.content_hash, chunk)
    header = tier.header(chunk.content_hash)
    assert header is not None
    return tier, chunk, header


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    tier = ChunkDiskTier(tmp_path, 10**8)
    chunk = make_chunk(1, dtype=dtype)
    assert tier.put(chunk.content_hash, chunk)
    stored = tier.get(chunk.content_hash)
    assert stored is not None
    assert_same(stored, chunk)
    assert tier.get("ab" * 32) is None
    stats = tier.stats()
    assert (stats.entries, stats.hits, stats.misses) == (1, 1, 1)


def test_sparse_read_returns_exactly_the_rows_and_reads_only_them(tmp_path: Path) -> None:
    tier, chunk, header = _stored_chunk(tmp_path, 2)
    key = chunk.content_hash
    rows = sorted(random.Random(0).sample(range(chunk.num_tokens), 40))  # 85 % kept
    layers = tier.read_layers(key, rows)
    dense = tier.read_layers(key, None)
    assert layers is not None and dense is not None
    for layer, got in enumerate(layers):
        assert torch.equal(got.keys, chunk.keys[layer][rows])
        assert torch.equal(got.values, chunk.values[layer][rows])
    sparse_bytes = sum(layer.bytes_read for layer in layers)
    dense_bytes = sum(layer.bytes_read for layer in dense)
    assert sparse_bytes == dense_bytes * 40 // 48


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0x40]))


def test_a_flipped_bit_is_never_served(tmp_path: Path) -> None:
    tier, chunk, header = _stored_chunk(tmp_path, 3)
    key = chunk.content_hash
    # Corrupt V row 5 of layer 1: a sparse read that skips it is still served (and verified) ...
    _flip_byte(tmp_path / f"{key}.chunk", header.value_offset(1) + 5 * header.value_row_bytes + 3)
    skipping = [r for r in range(chunk.num_tokens) if r != 5]
    assert tier.read_layers(key, skipping) is not None
    # ... a read that needs it drops the chunk, counts it, and returns nothing.
    assert tier.get(key) is None
    assert tier.stats().corrupt_dropped == 1 and key not in tier
    assert not (tmp_path / f"{key}.chunk").exists()


def test_restart_finds_chunks_and_drops_damaged_files(tmp_path: Path) -> None:
    clock = iter(range(100, 200))
    tier = ChunkDiskTier(tmp_path, 10**8, clock=lambda: float(next(clock)))
    chunks = [make_chunk(seed) for seed in range(3)]
    for chunk in chunks:
        tier.put(chunk.content_hash, chunk)
    tier.get(chunks[0].content_hash)  # now the most recently used
    (tmp_path / ".stray.chunk.0123.tmp").write_bytes(b"half a chunk")
    truncated = make_chunk(9)
    tier.put(truncated.content_hash, truncated)
    path = tmp_path / f"{truncated.content_hash}.chunk"
    path.write_bytes(path.read_bytes()[:-7])
    (tmp_path / f"{'cd' * 32}.chunk").write_bytes(b"not a chunk at all")

    reopened = ChunkDiskTier(tmp_path, 10**8)
    assert reopened.stats().corrupt_dropped == 2
    assert not list(tmp_path.glob("*.tmp"))
    assert reopened.keys_by_recency() == [c.content_hash for c in (chunks[1], chunks[2], chunks[0])]
    for chunk in chunks:
        stored = reopened.get(chunk.content_hash)
        assert stored is not None
        assert_same(stored, chunk)


def test_budget_evicts_the_least_recently_used(tmp_path: Path) -> None:
    clock = iter(range(100))
    probe = ChunkDiskTier(tmp_path / "probe", 10**8)
    chunks = [make_chunk(seed) for seed in range(3)]
    probe.put(chunks[0].content_hash, chunks[0])
    size = probe.stats().bytes_used
    # Room for two (file sizes differ by a few bytes of token ids), not three.
    tier = ChunkDiskTier(tmp_path / "tier", size * 5 // 2, clock=lambda: float(next(clock)))
    tier.put(chunks[0].content_hash, chunks[0])
    tier.put(chunks[1].content_hash, chunks[1])
    tier.get(chunks[0].content_hash)
    assert tier.put(chunks[2].content_hash, chunks[2])
    assert chunks[1].content_hash not in tier and chunks[0].content_hash in tier
    assert tier.stats().evictions == 1 and tier.stats().bytes_used <= size * 5 // 2
    assert not (tmp_path / "tier" / f"{chunks[1].content_hash}.chunk").exists()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_write_faults_leave_the_tier_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    tier = ChunkDiskTier(tmp_path, 10**8)
    kept = make_chunk(1)
    tier.put(kept.content_hash, kept)

    def failing_write(*args: object, **kwargs: object) -> Path:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(disk_tier, "write_temp", failing_write)
    chunk = make_chunk(2)
    assert not tier.put(chunk.content_hash, chunk)
    assert chunk.content_hash not in tier and tier.stats().write_errors == 1
    stored = tier.get(kept.content_hash)
    assert stored is not None
    assert_same(stored, kept)


def test_bad_settings_and_keys_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        ChunkDiskTier(tmp_path, 0)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="cannot create"):
        ChunkDiskTier(blocker / "sub", 10**6)
    tier = ChunkDiskTier(tmp_path / "ok", 10**6)
    with pytest.raises(ValueError, match="hex"):
        tier.put("../escape", make_chunk(1))


def _write_forever(directory: str, ready: Connection) -> None:
    """A writer process: puts the same six chunks in turn until it is killed."""
    torch.set_num_threads(1)  # forked from the test process: no OpenMP pool of its own
    tier = ChunkDiskTier(directory, 10**9)
    ready.send("ready")
    seed = 0
    while True:
        chunk = make_chunk(seed % 6, tokens=512, layers=4)
        tier.put(chunk.content_hash, chunk)
        seed += 1


def test_writers_killed_mid_write_never_leave_a_bad_chunk(tmp_path: Path) -> None:
    expected = {c.content_hash: c for c in (make_chunk(s, tokens=512, layers=4) for s in range(6))}
    rng = random.Random(7)
    found = interrupted = 0
    # Forked writers: a fresh interpreter per trial would spend its time importing torch.
    fork = multiprocessing.get_context("fork")
    for trial in range(20):
        ours, theirs = fork.Pipe()
        writer = fork.Process(target=_write_forever, args=(str(tmp_path), theirs), daemon=True)
        writer.start()
        assert ours.poll(60) and ours.recv() == "ready"
        time.sleep(rng.uniform(0.0, 0.4))
        os.kill(writer.pid or 0, signal.SIGKILL)
        writer.join()
        tier = ChunkDiskTier(tmp_path, 10**9)  # opens every time
        assert tier.stats().corrupt_dropped == 0, trial
        interrupted += tier.stats().interrupted_writes
        for key in tier.keys_by_recency():
            stored = tier.get(key)
            assert stored is not None, (trial, key)
            assert_same(stored, expected[key])
            found += 1
    assert found > 0 and interrupted > 0  # some kills did land in the middle of a write
