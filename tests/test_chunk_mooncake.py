"""The shared chunk tier on a real Mooncake master (loopback): two clients as two servers would
use it, verification of every read, the master stopping under them, and `ChunkTiers`'
promotion and demotion with it (host memory in front, as in the server)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_hicache_ext.fusion.chunk import PrecomputedChunk
from sglang_hicache_ext.fusion.rope import RopeSpec
from sglang_hicache_ext.sglang_ext.chunk_fusion.chunk_listing import describe_chunk, list_chunks
from sglang_hicache_ext.sglang_ext.chunk_fusion.registry import ChunkRegistry
from sglang_hicache_ext.sglang_ext.tools.mooncake_master import MooncakeMaster, running_master
from sglang_hicache_ext.tiers.chunks.chunk_tiers import MOONCAKE, ChunkTiers
from sglang_hicache_ext.tiers.chunks.dense_file import encode_chunk
from sglang_hicache_ext.tiers.chunks.header import ChunkSummary
from sglang_hicache_ext.tiers.chunks.host_cache import HostChunkCache
from sglang_hicache_ext.tiers.chunks.mooncake_client import MooncakeClient, MooncakeConfig
from sglang_hicache_ext.tiers.chunks.remote_catalog import ChunkCatalog
from sglang_hicache_ext.tiers.chunks.remote_tier import HEADER_SUFFIX, ChunkRemoteTier
from tests.test_chunk_disk import assert_same, make_chunk
from tests.test_chunk_tiers import ROPE, _same

CHUNK_BYTES = make_chunk(0).nbytes


_clients: list[MooncakeClient] = []


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    with running_master(tmp_path / "master.log") as started:
        yield started
        # Closed while the master runs: a client left to its destructor waits on a gone master.
        while _clients:
            _clients.pop().close()


def _client(master: MooncakeMaster, segment_bytes: int = 64 << 20) -> MooncakeClient:
    client = MooncakeClient(
        MooncakeConfig(master.address, segment_bytes=segment_bytes, local_buffer_bytes=16 << 20)
    )
    _clients.append(client)
    return client


def _tiered(remote: ChunkRemoteTier, host_chunks: int) -> ChunkTiers[PrecomputedChunk]:
    return ChunkTiers(
        HostChunkCache(host_chunks * CHUNK_BYTES),
        None,
        lambda tensors: PrecomputedChunk(*tensors),
        lambda chunk: ChunkSummary(chunk.num_tokens, chunk.num_layers, chunk.nbytes),
        remote=remote,
    )


def test_a_chunk_written_by_one_client_is_read_by_another(master: MooncakeMaster) -> None:
    writer = ChunkRemoteTier(_client(master), "model-a")
    reader = ChunkRemoteTier(_client(master, segment_bytes=0), "model-a")  # lends no memory
    other_model = ChunkRemoteTier(_client(master, segment_bytes=0), "model-b")
    chunk = make_chunk(1)
    key = chunk.content_hash
    assert writer.put(key, chunk) and key in writer
    assert key not in reader and reader.get(key) is None  # not known until discovered
    header = reader.discover(key)
    assert header is not None and header.token_ids == chunk.token_ids and key in reader
    assert_same(reader.get(key), chunk)
    assert other_model.discover(key) is None  # namespaces keep models' KV apart
    stats = reader.stats()
    assert (stats.discovered, stats.hits, stats.bytes_read) == (
        1,
        1,
        sum(map(len, encode_chunk(key, chunk))),
    )
    assert writer.stats().bytes_written == stats.bytes_read
    assert writer.remove(key) and reader.get(key) is None  # removed for every client
    assert reader.stats().misses == 1 and key not in reader


def test_a_damaged_object_is_dropped_and_never_returned(master: MooncakeMaster) -> None:
    client = _client(master)
    tier = ChunkRemoteTier(client, "m")
    dropped: list[str] = []
    tier.on_drop = dropped.append
    chunk = make_chunk(2)
    key = chunk.content_hash
    header, rows = encode_chunk(key, chunk)
    damaged = bytearray(rows)
    damaged[len(rows) // 2] ^= 0x10  # one bit of one row
    client.put(tier.prefix + key, header + bytes(damaged))
    client.put(tier.prefix + key + HEADER_SUFFIX, header)
    assert tier.discover(key) is not None  # the header is sound
    assert tier.get(key) is None
    assert tier.stats().corrupt_dropped == 1 and dropped == [key]
    assert not client.exists(tier.prefix + key)  # removed for every server
    client.put(tier.prefix + "f" * 64 + HEADER_SUFFIX, b"not a header")
    assert tier.discover("f" * 64) is None and tier.stats().corrupt_dropped == 2


def test_master_down_reads_and_writes_fail_counted(master: MooncakeMaster) -> None:
    tier = ChunkRemoteTier(_client(master), "m", retry_after_s=60)
    stored, later = make_chunk(3), make_chunk(4)
    assert tier.put(stored.content_hash, stored)
    master.kill()
    assert tier.get(stored.content_hash) is None  # the caller computes the tokens
    began = time.monotonic()
    # Within retry_after_s the store is not asked: no request pays the client's timeouts again.
    assert tier.get(stored.content_hash) is None
    assert not tier.put(later.content_hash, later)
    assert tier.discover(later.content_hash) is None
    assert time.monotonic() - began < 0.5
    stats = tier.stats()
    assert (stats.read_errors, stats.write_errors) == (3, 1)
    assert stored.content_hash in tier  # not forgotten: a transient failure is not a loss
    # The master back on its port: the client's close then gets answers instead of waiting out
    # the RPC timeouts of a gone master (11 s).
    master.start()


def test_tiered_store_demotes_to_and_fetches_from_the_shared_tier(master: MooncakeMaster) -> None:
    store = _tiered(ChunkRemoteTier(_client(master), "m"), host_chunks=1)
    first, second = make_chunk(5), make_chunk(6)
    for chunk in (first, second):
        assert store.put(chunk.content_hash, chunk) == []  # host eviction is a demotion
    assert store.tiers_of(first.content_hash) == [MOONCAKE]
    assert store.stats().demotions == 1
    pinned, lost = store.pin(first.content_hash)
    assert pinned is not None and pinned.tier == MOONCAKE and _same(pinned.chunk, first)
    assert lost == [] and store.stats().lookups[MOONCAKE] == 1
    store.unpin(first.content_hash)
    assert store.tiers_of(first.content_hash) == ["host", MOONCAKE]  # promoted


def test_registry_of_a_second_server_discovers_and_uses_a_chunk(master: MooncakeMaster) -> None:
    rope = RopeSpec(inv_freq=ROPE.inv_freq)
    first = ChunkRegistry(1 << 30, rope, remote=ChunkRemoteTier(_client(master), "m"))
    second = ChunkRegistry(
        1 << 30, rope, remote=ChunkRemoteTier(_client(master, segment_bytes=0), "m")
    )
    chunk = make_chunk(7, tokens=64)
    assert first.add(chunk)
    key = chunk.content_hash
    assert list_chunks(second) == []
    info = describe_chunk(second, key)  # what POST /chunks of the same tokens asks first
    assert info is not None and (info["tier"], info["tiers"]) == (MOONCAKE, [MOONCAKE])
    assert key in second.index and second.stats()["mooncake"]["discovered"] == 1
    held = second.pin(key)
    assert held is not None and held.tier == MOONCAKE and _same(held.chunk, chunk)
    second.unpin(key)
    assert describe_chunk(second, key)["tiers"] == ["host", MOONCAKE]
    assert second.stats()["hits_by_tier"] == {"host": 0, MOONCAKE: 1, "miss": 0}


def test_catalogue_loses_no_entry_to_racing_writers_nor_waits_forever_on_a_gap(
    master: MooncakeMaster,
) -> None:
    """Two writers appending at once (the store has no lock): every entry read exactly once.
    A writer that died between claiming a slot and filling it holds readers back only for
    `hole_timeout_s`; then the slot is skipped, counted, and the entries after it read."""
    clients = [_client(master), _client(master), _client(master, segment_bytes=0)]
    writers = [ChunkCatalog(clients[i], "ns/", f"server-{i}") for i in range(2)]
    reader = ChunkCatalog(clients[2], "ns/", "reader")

    def append(catalog: ChunkCatalog) -> None:
        for n in range(30):
            assert catalog.publish([f"{catalog.writer}-{n}"])

    threads = [threading.Thread(target=append, args=(w,)) for w in writers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    keys = [key for entry in reader.read_new() for key in entry.keys]
    assert sorted(keys) == sorted(f"server-{i}-{n}" for i in range(2) for n in range(30))
    assert reader.read_new() == []  # caught up
    assert sum(w.stats().published for w in writers) == 60 and reader.stats().read == 60

    writer = ChunkCatalog(clients[0], "gap/", "a")
    assert writer.publish(["first"])
    clients[1].put("gap/catalog/2", b'{"writer": "b", "keys": ["after-the-gap"]}')  # 1 empty
    reader = ChunkCatalog(clients[2], "gap/", "r", hole_timeout_s=0.3)
    assert [e.keys for e in reader.read_new()] == [("first",)]
    assert reader.read_new() == []  # still waiting for slot 1
    time.sleep(0.4)
    assert [e.keys for e in reader.read_new()] == [("after-the-gap",)]
    assert reader.stats().holes_skipped == 1
    assert writer.publish(["next"])  # after the last filled slot, never into the gap
    assert [(e.writer, e.keys) for e in reader.read_new()] == [("a", ("next",))]


def test_registry_indexes_a_chunk_another_server_announced(master: MooncakeMaster) -> None:
    """Captured anywhere, reused everywhere: the second registry knows the first's chunk from
    the catalogue alone (no registration of the same tokens), and reads it from the store."""
    rope = RopeSpec(inv_freq=ROPE.inv_freq)
    first = ChunkRegistry(1 << 30, rope, remote=ChunkRemoteTier(_client(master), "m", writer="a:1"))
    second = ChunkRegistry(
        1 << 30,
        rope,
        remote=ChunkRemoteTier(_client(master, segment_bytes=0), "m", writer="b:2", poll_s=0),
    )
    chunk = make_chunk(7, tokens=64)
    assert first.add(chunk)
    key = chunk.content_hash
    prompt = [1, 2, 3, *chunk.token_ids, 4, 5]
    assert second.index.find(prompt) == []
    (match,) = second.find(prompt)  # reads the catalogue first
    assert second.sync_shared() == 0  # nothing new
    assert (match.chunk_id, match.prompt_start) == (key, 3)
    assert second.store.remote is not None and second.store.remote.writer_of[key] == "a:1"
    held = second.pin(key)
    assert held is not None and held.tier == MOONCAKE and _same(held.chunk, chunk)
    second.unpin(key)
    stats = second.stats()
    assert stats["found_in_shared_tier"] == 1 and stats["mooncake"]["catalog"]["read"] == 1
    assert first.sync_shared() == 0  # its own announcement: known already


def test_a_full_store_keeps_the_chunk_here_and_announces_nothing(master: MooncakeMaster) -> None:
    """A write the store cannot take (its memory full) is counted; the chunk stays in host
    memory, and other servers are not told of a chunk they could not read."""
    remote = ChunkRemoteTier(_client(master, segment_bytes=16 << 20), "full", writer="a:1")
    chunk = make_chunk(3, tokens=24_000)
    assert chunk.nbytes > 16 << 20  # more than the whole store (16 MiB: Mooncake's least)
    tiers = _tiered(remote, host_chunks=1 + chunk.nbytes // CHUNK_BYTES)
    tiers.put(chunk.content_hash, chunk)
    stats = remote.stats()
    assert stats.write_errors == 1 and stats.catalog is not None
    assert (stats.catalog.published, stats.catalog.publish_errors) == (0, 0)
    assert tiers.tiers_of(chunk.content_hash) == ["host"]
