"""Host memory's retention by utility on real chunk rows and codecs: a chunk is compressed before
one is dropped, a compression over the quality floor is not kept (counted), the chunk reused
most keeps its place against the most recent one, admission weighs only what would be dropped,
and the disk tier's budget gives up the least reused first."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_hicache_ext.fusion.chunk import PrecomputedChunk
from sglang_hicache_ext.tiers.chunks.admission import FrequencyAdmission
from sglang_hicache_ext.tiers.chunks.disk_tier import ChunkDiskTier
from sglang_hicache_ext.tiers.chunks.header import CorruptChunkError
from sglang_hicache_ext.tiers.chunks.host_cache import (
    HostCacheFullError,
    HostChunkCache,
    NotAdmittedError,
)
from sglang_hicache_ext.tiers.chunks.retention import UtilityRetention
from sglang_hicache_ext.tiers.chunks.stored_forms import (
    StoredBlob,
    StoredChunkForms,
    decode_chunk,
    encode_stored,
    kv_error,
)
from tests.test_chunk_disk import make_chunk

HostValue = PrecomputedChunk | StoredBlob
CHUNK_BYTES = make_chunk(0).nbytes
# Measured on make_chunk's Gaussian rows (real KV is kinder: docs/compression-placement.md).
INT8_ERROR = StoredChunkForms(lambda b: b, lambda k: False).compress("ab", make_chunk(0), "int8")[1]


def _key(seed: int) -> str:
    return f"{seed:032x}"


def _host(
    chunks: float,
    max_error: float,
    admission: FrequencyAdmission | None = None,
    below: set[str] | None = None,
) -> HostChunkCache[HostValue]:
    retention: UtilityRetention[HostValue] = UtilityRetention(max_error, admission=admission)
    kept_below = below if below is not None else set()
    retention.bind(StoredChunkForms(lambda blob: blob, kept_below.__contains__))
    return HostChunkCache(int(chunks * CHUNK_BYTES), admission, retention)


def _read(host: HostChunkCache[HostValue], seed: int, times: int) -> None:
    for _ in range(times):
        assert host.get(_key(seed)) is not None


def test_a_chunk_is_compressed_before_one_is_dropped() -> None:
    host = _host(2.5, max_error=0.01)
    for seed in (0, 1):
        host.put(_key(seed), make_chunk(seed))
        _read(host, seed, 3)
    host.put(_key(2), make_chunk(2))
    stats = host.stats()
    assert (stats.entries, stats.evictions, stats.compressed_to_int8) == (3, 0, 1)
    assert stats.bytes_used <= stats.capacity_bytes
    compressed = [seed for seed in (0, 1) if isinstance(host.peek(_key(seed)), StoredBlob)]
    assert len(compressed) == 1  # one step freed enough
    (seed,) = compressed
    blob = host.peek(_key(seed))
    assert isinstance(blob, StoredBlob) and blob.header.codec == "int8"
    rows = decode_chunk(blob.data, _key(seed))
    assert rows.token_ids == make_chunk(seed).token_ids
    assert 0 < kv_error(make_chunk(seed), rows) <= 0.01


def test_a_compression_over_the_floor_is_not_kept_and_is_counted() -> None:
    host = _host(2.5, max_error=INT8_ERROR / 2)
    for seed in (0, 1):
        host.put(_key(seed), make_chunk(seed))
    _read(host, 0, 3)  # 0 is worth more: 1 goes
    host.put(_key(2), make_chunk(2))
    stats = host.stats()
    assert stats.compressed_to_int8 == 0 and stats.compression_refused >= 1
    assert (stats.entries, stats.evictions) == (2, 1)
    assert _key(1) not in host and isinstance(host.peek(_key(0)), PrecomputedChunk)


def test_int4_past_the_floor_is_refused_after_int8_was_kept() -> None:
    host = _host(1.0, max_error=INT8_ERROR * 1.5)  # int8 fits the floor, int8 + int4 does not
    assert host.retention is not None
    host.retention.costs.step_error["int4"] = 0.0  # a prior that has int4 tried
    host.put(_key(0), make_chunk(0))
    _read(host, 0, 5)
    host.put(_key(1), make_chunk(1, tokens=12))  # a quarter of a chunk: 0 goes int8
    host.put(_key(2), make_chunk(2, tokens=20))  # 0's int4 tried and refused, 1 goes int8
    stats = host.stats()
    assert (stats.compressed_to_int8, stats.compression_refused, stats.compressed_to_int4) == (
        2,
        1,
        0,
    )
    assert (stats.entries, stats.evictions) == (3, 0)
    held = host.peek(_key(0))
    assert isinstance(held, StoredBlob) and held.header.codec == "int8"
    # The measured int4 error replaced the prior: the planner proposes it no more.
    assert host.retention.costs.step_error["int4"] > INT8_ERROR


def test_the_chunk_reused_most_outlasts_the_most_recent() -> None:
    """Without compression (floor 0) retention drops by worth, where LRU drops the oldest."""
    lru: HostChunkCache[HostValue] = HostChunkCache(2 * CHUNK_BYTES)
    host = _host(2, max_error=0.0)
    for cache in (lru, host):
        cache.put(_key(0), make_chunk(0))
        for _ in range(4):
            cache.get(_key(0))
        cache.put(_key(1), make_chunk(1))  # a one-off, the most recent
        cache.put(_key(2), make_chunk(2))
    assert _key(0) not in lru and _key(1) in lru
    assert _key(0) in host and _key(1) not in host
    assert host.stats().compression_refused == 0  # a step over the floor is not even tried


def test_a_chunk_a_lower_tier_keeps_is_demoted_before_one_that_would_be_lost() -> None:
    host = _host(2, max_error=0.0, below={_key(0)})
    host.put(_key(0), make_chunk(0))
    host.put(_key(1), make_chunk(1))
    _read(host, 0, 1)  # equal uses; 0 more recent, but dropping it loses only a disk read
    _read(host, 1, 1)
    host.put(_key(2), make_chunk(2))
    assert _key(0) not in host and _key(1) in host


def test_pinned_chunks_are_neither_compressed_nor_dropped() -> None:
    host = _host(2.5, max_error=0.01)
    for seed in (0, 1):
        host.put(_key(seed), make_chunk(seed))
        host.pin(_key(seed))
    with pytest.raises(Exception, match="pinned"):
        host.put(_key(2), make_chunk(2))
    assert all(isinstance(host.peek(_key(s)), PrecomputedChunk) for s in (0, 1))
    assert host.stats().compressed_to_int8 == 0


def test_admission_weighs_only_the_chunks_the_plan_drops() -> None:
    """A one-off that fits once a popular chunk is compressed costs nobody a place; the next
    one-off, which would need a drop, is refused at the door."""
    admission = FrequencyAdmission.for_entries(64)
    host = _host(2.0, max_error=0.01, admission=admission)
    host.put(_key(0), make_chunk(0))
    for _ in range(4):
        admission.record(_key(0))
    _read(host, 0, 4)
    admission.record(_key(1))
    host.put(_key(1), make_chunk(1, tokens=30), by_frequency=True)  # fits
    admission.record(_key(2))
    host.put(_key(2), make_chunk(2, tokens=30), by_frequency=True)  # after a compression
    assert host.stats().compressed_to_int8 >= 1 and host.stats().refused_by_frequency == 0
    admission.record(_key(3))
    assert not host.would_admit(_key(3), CHUNK_BYTES)
    with pytest.raises(NotAdmittedError):
        host.put(_key(3), make_chunk(3), by_frequency=True)
    assert _key(0) in host and host.stats().refused_by_frequency == 1


def test_the_disk_budget_gives_up_the_least_reused_first(tmp_path: Path) -> None:
    disk = ChunkDiskTier(tmp_path, 2 * (CHUNK_BYTES + 4096))
    reuse = {_key(0): 5.0}
    disk.keep_score = lambda key: reuse.get(key, 1.0)
    for seed in range(4):  # 0 is the oldest and the most reused
        assert disk.put_stored(_key(seed), *encode_stored(_key(seed), make_chunk(seed), None))
        assert _key(seed) in disk  # the chunk just written is never the one evicted
    assert _key(0) in disk and _key(3) in disk and disk.stats().evictions == 2


def test_uses_decay_and_out_of_range_floors_are_refused() -> None:
    retention: UtilityRetention[HostValue] = UtilityRetention(0.01)
    retention.uses.window = 4
    for _ in range(3):
        retention.read("a")
    retention.read("b")  # the fourth use halves every count
    assert retention.frequency("a") == pytest.approx(1.5)
    with pytest.raises(ValueError, match="max_error"):
        UtilityRetention(1.0)


def test_a_compression_that_fails_is_counted_and_room_is_made_by_dropping(
    caplog: pytest.LogCaptureFixture,
) -> None:
    host = _host(2.5, max_error=0.01)
    assert host.retention is not None and host.retention.forms is not None
    forms = host.retention.forms

    class FailingForms(StoredChunkForms[HostValue]):
        def compress(self, key: str, value: HostValue, to: str) -> tuple[HostValue, float]:
            raise CorruptChunkError(f"{key[:12]}: layer 0 fails its checksum")

    host.retention.bind(FailingForms(lambda blob: blob, forms.below))
    for seed in range(3):
        host.put(_key(seed), make_chunk(seed))
    stats = host.stats()
    assert stats.compression_refused >= 1 and stats.compressed_to_int8 == 0
    assert (stats.entries, stats.evictions) == (2, 1)
    assert "not compressed to int8" in caplog.text


def test_bytes_by_form_follow_every_change_to_host_memory() -> None:
    """The per-form bytes are kept as entries come and go (not counted by a walk on each
    `stats`): after compressions, drops, a replacement, a removal and reads they equal a walk
    of what host memory holds."""
    host = _host(3.5, max_error=0.01)
    forms = host.retention.forms if host.retention is not None else None
    assert forms is not None

    def walked() -> dict[str, int]:
        totals: dict[str, int] = {}
        for _, value in host.items():
            totals[forms.form(value)] = totals.get(forms.form(value), 0) + forms.nbytes(value)
        return totals

    for seed in range(8):
        host.put(_key(seed), make_chunk(seed))
        _read(host, seed, seed % 3)
        assert host.stats().bytes_by_form == walked()
    stats = host.stats()
    assert stats.compressed_to_int8 >= 1 and stats.evictions >= 1
    assert set(stats.bytes_by_form) == {"none", "int8"}
    host.put(_key(7), make_chunk(70))  # a replacement
    assert host.remove(_key(7))
    assert host.stats().bytes_by_form == walked()
    held = [key for key, _ in host.items()]
    for key in held:
        host.pin(key)
    with pytest.raises(HostCacheFullError):  # once all is pinned: refused, nothing changed
        for seed in range(100, 110):
            host.put(_key(seed), make_chunk(seed))
            held.append(_key(seed))
            host.pin(_key(seed))
    assert host.stats().bytes_by_form == walked()
    for key in held:
        host.unpin(key)
