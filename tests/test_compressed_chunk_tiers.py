"""Chunks stored compressed in the disk and Mooncake tiers: fewer bytes stored and read, the
same rows from every tier (host memory holds what the codec decodes to), layer reads decoded
in the load path, restarts, and a damaged compressed layer dropped, counted and never served."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sglang_hicache_ext.fusion.chunk import PrecomputedChunk
from sglang_hicache_ext.fusion.rope import RopeSpec
from sglang_hicache_ext.sglang_ext.chunk_fusion.chunk_listing import describe_chunk, list_chunks
from sglang_hicache_ext.sglang_ext.chunk_fusion.registry import (
    ChunkRegistry,
    HostChunk,
    host_chunk,
    readable,
    summarize,
)
from sglang_hicache_ext.sglang_ext.chunk_fusion.streamed_chunk import StreamedChunk
from sglang_hicache_ext.sglang_ext.tools.mooncake_master import MooncakeMaster, running_master
from sglang_hicache_ext.tiers.chunks.chunk_tensors import ChunkTensors
from sglang_hicache_ext.tiers.chunks.chunk_tiers import ChunkTiers
from sglang_hicache_ext.tiers.chunks.disk_tier import CHUNK_SUFFIX, ChunkDiskTier
from sglang_hicache_ext.tiers.chunks.header import CorruptChunkError
from sglang_hicache_ext.tiers.chunks.host_cache import HostChunkCache
from sglang_hicache_ext.tiers.chunks.mooncake_client import MooncakeClient, MooncakeConfig
from sglang_hicache_ext.tiers.chunks.remote_tier import ChunkRemoteTier
from sglang_hicache_ext.tiers.chunks.stored_forms import (
    StoredBlob,
    read_header,
    stored_codec,
    through_codec,
)
from tests.test_chunk_disk import make_chunk

CODECS = ["int8", "int4"]
DTYPES = [torch.float32, torch.bfloat16]
# Stored layer bytes of a 128-token chunk (2 heads x 16 dims: small rows, so the fp16 group
# scales weigh more than on a real model's 64-dim heads) over its dense bytes.
RATIO_BOUND = {("int8", torch.float32): 0.33, ("int4", torch.float32): 0.2}
RATIO_BOUND |= {("int8", torch.bfloat16): 0.66, ("int4", torch.bfloat16): 0.4}
METADATA = 0.05  # a whole stored chunk also holds its token ids and frequency scores


def _tiered(tmp_path: Path, host_bytes: int) -> ChunkTiers[HostChunk]:
    """The tiers as the server's registry builds them."""
    return ChunkTiers(
        HostChunkCache(host_bytes),
        ChunkDiskTier(tmp_path, 10**8),
        host_chunk,
        summarize,
        StreamedChunk,
    )


def _equal(expected: PrecomputedChunk, got: object) -> bool:
    """`got` (a host chunk or rows read back) holds exactly `expected`'s tokens, scores and rows."""
    if isinstance(got, ChunkTensors):
        got = PrecomputedChunk(*got)
    chunk = readable(got) if isinstance(got, HostChunk) else got  # type: ignore[arg-type]
    every = torch.arange(expected.num_tokens)
    rows = [chunk.rows(layer, every) for layer in range(expected.num_layers)]
    pairs = zip(
        (*expected.keys, *expected.values),
        (*(k for k, _ in rows), *(v for _, v in rows)),
        strict=True,
    )
    same_rows = all(x.dtype == y.dtype and torch.equal(x, y) for x, y in pairs)
    return (
        chunk.token_ids == expected.token_ids
        and same_rows
        and torch.equal(chunk.freq_scores, expected.freq_scores)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", CODECS)
def test_every_tier_gives_back_what_the_codec_decodes_to(
    tmp_path: Path, spec: str, dtype: torch.dtype
) -> None:
    chunk, other = make_chunk(1, tokens=128, dtype=dtype), make_chunk(2, tokens=128, dtype=dtype)
    codec = stored_codec(spec)
    expected = PrecomputedChunk(*through_codec(chunk, codec))
    assert not _equal(expected, chunk)  # lossy: host memory must not keep the original
    store = _tiered(tmp_path, host_bytes=int(1.5 * RATIO_BOUND[spec, dtype] * chunk.nbytes))
    store.put(chunk.content_hash, chunk, codec)
    key = chunk.content_hash
    held = store.host.peek(key)  # the compressed bytes, counted as such by the host budget
    assert isinstance(held, StoredBlob)
    assert held.nbytes <= (RATIO_BOUND[spec, dtype] + METADATA) * chunk.nbytes
    assert _equal(expected, held)
    assert store.put(other.content_hash, other, codec) == []
    assert store.tiers_of(key) == ["disk"]  # demoted by the second chunk
    (path,) = tmp_path.glob(f"{key}{CHUNK_SUFFIX}")
    header = read_header(path)
    assert header.codec == spec and header.token_ids == chunk.token_ids
    layers = sum(int(layer["length"]) for layer in header.compressed.layers)  # type: ignore[union-attr]
    assert layers <= RATIO_BOUND[spec, dtype] * header.num_layers * header.layer_bytes
    assert _equal(expected, store.disk.get(key))  # type: ignore[union-attr]
    # Streamed: rows read a layer at a time, each layer decoded whole (smaller than its rows).
    pinned, _ = store.pin(key)
    assert pinned is not None and pinned.tier == "disk" and isinstance(pinned.chunk, StreamedChunk)
    rows = torch.tensor([0, 5, 6, 127])
    for layer in range(chunk.num_layers):
        keys, values = pinned.chunk.rows(layer, rows)
        assert torch.equal(keys, expected.keys[layer][rows])
        assert torch.equal(values, expected.values[layer][rows])
    assert pinned.chunk.stats.bytes_read <= RATIO_BOUND[spec, dtype] * pinned.chunk.dense_bytes
    store.unpin(key)
    store.wait_for_promotions()
    promoted, _ = store.pin(key)  # promoted to host memory: the compressed file's bytes
    assert promoted is not None and promoted.tier == "host"
    assert isinstance(promoted.chunk, StoredBlob) and _equal(expected, promoted.chunk)
    store.unpin(key)


def test_a_damaged_compressed_layer_is_dropped_counted_and_never_served(tmp_path: Path) -> None:
    chunk, other = make_chunk(3, tokens=128), make_chunk(4, tokens=128)
    store = _tiered(tmp_path, host_bytes=chunk.nbytes // 3)
    for item in (chunk, other):
        store.put(item.content_hash, item, stored_codec("int8"))
    key = chunk.content_hash
    (path,) = tmp_path.glob(f"{key}{CHUNK_SUFFIX}")
    layer = read_header(path).compressed.layers[1]  # type: ignore[union-attr]
    offset = read_header(path).data_offset + layer["offset"] + layer["length"] // 2
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0x10]))
    pinned, _ = store.pin(key)
    assert pinned is not None and isinstance(pinned.chunk, StreamedChunk)
    pinned.chunk.rows(0, torch.arange(4))  # layer 0 is intact
    with pytest.raises(CorruptChunkError, match="layer 1"):
        pinned.chunk.rows(1, torch.arange(4))
    store.unpin(key)
    assert key not in store and not path.exists()
    assert store.disk.stats().corrupt_dropped == 1  # type: ignore[union-attr]
    assert store.pin(key)[0] is None  # the caller computes the tokens instead


def test_compressed_chunks_are_found_with_their_codec_after_a_restart(tmp_path: Path) -> None:
    rope = RopeSpec(inv_freq=torch.ones(8))
    first = ChunkRegistry(1 << 30, rope, disk=ChunkDiskTier(tmp_path, 10**8))
    chunks = {
        "int8": make_chunk(5, tokens=96),
        "int4": make_chunk(6, tokens=96),
        None: make_chunk(7),
    }
    for spec, chunk in chunks.items():
        assert first.add(chunk, spec)
    listed = {c["id"]: c["codec"] for c in list_chunks(first)}
    assert listed == {chunk.content_hash: spec for spec, chunk in chunks.items()}
    again = ChunkRegistry(1 << 30, rope, disk=ChunkDiskTier(tmp_path, 10**8))
    assert again.restored == 3
    assert {c["id"]: (c["codec"], c["tier"]) for c in list_chunks(again)} == {
        chunk.content_hash: (spec, "disk") for spec, chunk in chunks.items()
    }
    for spec, chunk in chunks.items():
        pinned = again.pin(chunk.content_hash)
        assert pinned is not None
        expected = (
            chunk if spec is None else PrecomputedChunk(*through_codec(chunk, stored_codec(spec)))
        )
        for layer in range(chunk.num_layers):
            every = torch.arange(chunk.num_tokens)
            assert torch.equal(pinned.chunk.rows(layer, every)[0], expected.keys[layer])
        again.unpin(chunk.content_hash)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("zstd", "unknown codec 'zstd'; stored chunks take int8 or int4"),
        ("knorm:1.5", "drop ratio must be in (0, 1), got 1.5"),
        ("snapkv:0", "drop ratio must be in (0, 1), got 0"),
        ("knorm:0.5", "drops tokens; stored chunks take int8 or int4"),
    ],
)
def test_codecs_tiers_cannot_store_are_refused_by_name(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        stored_codec(spec)


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    with running_master(tmp_path / "master.log") as started:
        yield started


def test_a_compressed_chunk_in_the_shared_tier_is_found_and_read_by_another_server(
    master: MooncakeMaster,
) -> None:
    clients = [
        MooncakeClient(MooncakeConfig(master.address, segment_bytes=s, local_buffer_bytes=16 << 20))
        for s in (64 << 20, 0)
    ]
    try:
        rope = RopeSpec(inv_freq=torch.ones(8))
        writer = ChunkRegistry(1 << 30, rope, remote=ChunkRemoteTier(clients[0], "m"))
        reader = ChunkRegistry(1 << 30, rope, remote=ChunkRemoteTier(clients[1], "m"))
        chunk = make_chunk(8, tokens=128)
        assert writer.add(chunk, "int4")
        info = describe_chunk(reader, chunk.content_hash)
        assert info is not None and info["codec"] == "int4" and info["tier"] == "mooncake"
        pinned = reader.pin(chunk.content_hash)
        expected = PrecomputedChunk(*through_codec(chunk, stored_codec("int4")))
        assert pinned is not None and _equal(expected, pinned.chunk)
        reader.unpin(chunk.content_hash)
        stats = reader.stats()["mooncake"]
        dense = chunk.num_layers * 2 * chunk.keys[0].numel() * 4
        assert stats["bytes_read"] < 0.25 * dense, stats
    finally:
        for client in clients:
            client.close()
