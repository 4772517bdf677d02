"""The placement's scheduler side on the registry the server uses (real disk tier): what it
reports of each chunk, the rows a probe reads, host forms applied without losing anything,
refusals while a request holds a chunk, and the read counts real requests leave."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sglang_hicache_ext.fusion.chunk import PrecomputedChunk
from sglang_hicache_ext.fusion.rope import RopeSpec
from sglang_hicache_ext.sglang_ext.chunk_fusion import placement_control
from sglang_hicache_ext.sglang_ext.chunk_fusion.chunk_listing import chunk_control, list_chunks
from sglang_hicache_ext.sglang_ext.chunk_fusion.chunk_matches import (
    pin_request_chunks,
    pinned_chunk_segments,
    unpin_chunks,
)
from sglang_hicache_ext.sglang_ext.chunk_fusion.placement_control import UNAVAILABLE
from sglang_hicache_ext.sglang_ext.chunk_fusion.placement_probe import (
    PROBE_FORM_PARAM,
    check_probe_params,
    probing_placement,
)
from sglang_hicache_ext.sglang_ext.chunk_fusion.registry import ChunkRegistry
from sglang_hicache_ext.tiers.chunks.disk_tier import ChunkDiskTier
from sglang_hicache_ext.tiers.chunks.stored_forms import StoredBlob, stored_codec, through_codec
from tests.test_chunk_disk import make_chunk

ROPE = RopeSpec(inv_freq=torch.ones(8))


def _registry(tmp_path: Path, host_bytes: int) -> tuple[ChunkRegistry, list[PrecomputedChunk]]:
    registry = ChunkRegistry(host_bytes, ROPE, disk=ChunkDiskTier(tmp_path, 10**8))
    chunks = [make_chunk(seed, tokens=64) for seed in range(3)]
    for chunk in chunks:
        assert registry.add(chunk)
    return registry, chunks


def _rows(chunk: object, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    every = torch.arange(chunk.num_tokens)  # type: ignore[attr-defined]
    return chunk.rows(layer, every)  # type: ignore[attr-defined]


def test_inputs_report_every_form_and_the_reads(tmp_path: Path) -> None:
    registry, chunks = _registry(tmp_path, 10 * chunks_bytes())
    prompt = [7, *chunks[0].token_ids, 9, 8, 7]
    probe = pin_request_chunks(registry, prompt, "int8")  # a probe's reads are not traffic
    assert probe.pinned == [chunks[0].content_hash]
    unpin_chunks(registry, probe.pinned, "int8")
    held = pin_request_chunks(registry, prompt, None)  # a real request's: the chunk's read
    unpin_chunks(registry, held.pinned, None)
    assert not registry.store.host.pinned(chunks[0].content_hash)
    inputs = chunk_control(registry, "hicache_ext.placement.inputs", {})[0]
    by_id = {c["id"]: c for c in inputs["chunks"]}
    assert set(by_id) == {c.content_hash for c in chunks}
    first = by_id[chunks[0].content_hash]
    assert (first["registered"], first["host_form"], first["num_tokens"]) == ("none", "none", 64)
    assert first["nbytes"]["none"] == chunks[0].nbytes
    assert (
        first["nbytes"]["int4"] < first["nbytes"]["int8"] < 0.5 * chunks[0].nbytes
    )  # tiny: headers
    assert first["decode_s"]["none"] == 0.0 and first["decode_s"]["int8"] > 0
    assert (first["frequency"], first["questions"]) == (1.0, [[9, 8, 7]])
    assert not first["estimated"]  # three small chunks: measured within the budget
    assert inputs["capacities"] == {"host": 10 * chunks_bytes(), "disk": 10**8}
    assert inputs["host_bytes_outside"] == 0 and inputs["disk_bytes_per_s"] > 0
    # An applied round turns its reads into history (halved at the next round).
    chunk_control(registry, "hicache_ext.placement.apply", {"forms": {}})
    again = chunk_control(registry, "hicache_ext.placement.inputs", {})[0]
    assert {c["id"]: c["frequency"] for c in again["chunks"]}[chunks[0].content_hash] == 0.5


def test_chunks_beyond_the_measuring_budget_are_estimated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(placement_control, "MEASURE_BUDGET_S", 0.0)  # one chunk per call
    registry, chunks = _registry(tmp_path, 10 * chunks_bytes())
    first = chunk_control(registry, "hicache_ext.placement.inputs", {})[0]
    assert sorted(first["stored"]) == sorted(c.content_hash for c in chunks)
    estimated = [c for c in first["chunks"] if c["estimated"]]
    measured = [c for c in first["chunks"] if not c["estimated"]]
    assert len(measured) == 1 and len(estimated) == 2
    for chunk in estimated:  # the registered size exactly, the others per token alike
        assert chunk["nbytes"]["none"] == chunks_bytes()
        assert chunk["nbytes"]["int8"] == pytest.approx(measured[0]["nbytes"]["int8"], rel=0.01)
    again = chunk_control(registry, "hicache_ext.placement.inputs", {})[0]
    assert sum(not c["estimated"] for c in again["chunks"]) == 2


def test_probe_rows_are_the_registered_rows_through_the_codec(tmp_path: Path) -> None:
    registry, chunks = _registry(tmp_path, 10 * chunks_bytes())
    key = chunks[1].content_hash
    for form in ("none", "int8", "int4"):
        pinned = registry.pin_form(key, form)
        assert pinned is not None and pinned.tier == "disk"
        expected = (
            chunks[1]
            if form == "none"
            else PrecomputedChunk(*through_codec(chunks[1], stored_codec(form)))
        )
        for layer in range(chunks[1].num_layers):
            for got, want in zip(_rows(pinned.chunk, layer), _rows(expected, layer), strict=True):
                assert torch.equal(got, want)
        registry.unpin(key, probe=True)  # the probe's own copy: host memory's pins untouched
    assert registry.store.host.stats().hits == 0
    with pytest.raises(ValueError, match="not held by a probe"):
        registry.unpin(key, probe=True)
    with pytest.raises(ValueError, match="not pinned"):
        registry.unpin(key)
    assert registry.pin_form(key, "zstd") is None  # refused (counted), never raised into a forward
    assert registry.placement.counters["probe_form_refused"] == 1


def test_applied_forms_change_host_memory_and_keep_the_disk_rows(tmp_path: Path) -> None:
    registry, chunks = _registry(tmp_path, 10 * chunks_bytes())
    a, b, c = (chunk.content_hash for chunk in chunks)
    chunk_control(registry, "hicache_ext.placement.inputs", {})
    applied = chunk_control(
        registry, "hicache_ext.placement.apply", {"forms": {a: "int8", b: None, c: "none"}}
    )[0]
    assert applied["outcomes"] == {"changed": 1, "dropped": 1, "kept": 1}
    listing = {info["id"]: info for info in list_chunks(registry)}
    assert (listing[a]["tier"], listing[a]["codec"], listing[a]["registered_codec"]) == (
        "host",
        "int8",
        None,
    )
    assert (listing[b]["tier"], listing[b]["codec"]) == ("disk", None)
    assert (listing[c]["tier"], listing[c]["codec"]) == ("host", None)
    assert isinstance(registry.store.host.peek(a), StoredBlob)
    # A request now reads a's int8 form from host memory; the disk still has its dense rows.
    held = pinned_chunk_segments(registry, [5, *chunks[0].token_ids, 6])
    assert held.tiers == {"host": 1}
    registry.unpin(a)
    assert registry.pin_form(a, "none") is not None
    registry.unpin(a, probe=True)
    # Back to dense: made from the disk's registered rows, exactly.
    chunk_control(registry, "hicache_ext.placement.apply", {"forms": {a: "none"}})
    restored = registry.store.host.peek(a)
    assert isinstance(restored, PrecomputedChunk)
    assert all(torch.equal(x, y) for x, y in zip(restored.keys, chunks[0].keys, strict=True))
    # Reads no longer put chunks back into host memory: the placement decides.
    assert registry.store.promote_on_read is False


def test_a_chunk_in_use_is_left_as_it_is_and_nothing_is_evicted(tmp_path: Path) -> None:
    registry, chunks = _registry(tmp_path, 10 * chunks_bytes())
    key = chunks[0].content_hash
    assert registry.pin(key) is not None
    for form in (None, "int8"):
        applied = chunk_control(registry, "hicache_ext.placement.apply", {"forms": {key: form}})[0]
        assert applied["outcomes"] == {"busy": 1}
    assert registry.host_form(key) == "none"
    registry.unpin(key)
    gone = "0" * 64
    applied = chunk_control(registry, "hicache_ext.placement.apply", {"forms": {gone: "int8"}})[0]
    assert applied["outcomes"] == {"gone": 1}
    with pytest.raises(ValueError, match="cannot be held as"):
        chunk_control(registry, "hicache_ext.placement.apply", {"forms": {key: "zstd"}})


def test_applied_forms_never_evict_and_go_smallest_first(tmp_path: Path) -> None:
    # Host memory holds two of the three chunks dense: the third cannot grow into it unless
    # the others shrink first, and a grow that does not fit evicts nothing.
    registry, chunks = _registry(tmp_path, 2 * chunks_bytes())
    a, b, c = (chunk.content_hash for chunk in chunks)
    assert [registry.host_form(k) for k in (a, b, c)] == [None, "none", "none"]
    chunk_control(registry, "hicache_ext.placement.inputs", {})
    applied = chunk_control(
        registry, "hicache_ext.placement.apply", {"forms": {a: "none", b: "int8", c: "int4"}}
    )[0]
    assert applied["outcomes"] == {"changed": 3}  # b and c shrank before a grew
    assert [registry.host_form(k) for k in (a, b, c)] == ["none", "int8", "int4"]
    applied = chunk_control(
        registry, "hicache_ext.placement.apply", {"forms": {b: "none", c: "none"}}
    )[0]
    assert applied["outcomes"] == {"no_room": 2}  # neither fits beside a: nothing evicted
    assert [registry.host_form(k) for k in (a, b, c)] == ["none", "int8", "int4"]
    assert registry.store.host.stats().bytes_used <= 2 * chunks_bytes()
    assert registry.stats()["lost"] == 0 and registry.store.host.stats().evictions == 1


def test_without_a_disk_the_placement_is_unavailable() -> None:
    registry = ChunkRegistry(10**6, ROPE)
    with pytest.raises(RuntimeError, match="needs a disk tier"):
        chunk_control(registry, "hicache_ext.placement.inputs", {})
    assert "chunk_disk_dir" in UNAVAILABLE


def test_clients_cannot_send_the_probe_key() -> None:
    check_probe_params({"fusion": True})
    with pytest.raises(ValueError, match="internal to the chunk placement"):
        check_probe_params({PROBE_FORM_PARAM: "int8"})
    token = probing_placement.set(True)
    try:
        check_probe_params({PROBE_FORM_PARAM: "int8"})
        with pytest.raises(ValueError, match="must be one of"):
            check_probe_params({PROBE_FORM_PARAM: "knorm:0.5"})
    finally:
        probing_placement.reset(token)


def chunks_bytes() -> int:
    return make_chunk(0, tokens=64).nbytes
