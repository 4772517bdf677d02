"""Fused prefill over chunks streamed from the disk tier: the same result as from memory, only
the rows not recomputed are read (every one verified), overlapped or not; a corrupt row is
never used."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sglang_hicache_ext.fusion.adapters.hf import HFCausalLMAdapter
from sglang_hicache_ext.fusion.executor import fused_prefill, fused_prefill_batch
from sglang_hicache_ext.fusion.request import ChunkSegment, Segment, TextSegment
from sglang_hicache_ext.fusion.request_state import FusionJob
from sglang_hicache_ext.fusion.selectors import make_selector
from sglang_hicache_ext.sglang_ext.chunk_fusion.streamed_chunk import StreamedChunk
from sglang_hicache_ext.tiers.chunks.disk_tier import ChunkDiskTier
from sglang_hicache_ext.tiers.chunks.header import CorruptChunkError
from tests.test_fusion_executor import FAMILIES, _hf_prefix, _rag_request, selector_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# freq selects before the first layer; a3 and question_error at their check layer;
# question_attention inline on these small requests, and after a scoring pass that reads the
# rows too (":pass").
SELECTORS = ["freq", "a3", "question_error", "question_attention", "question_attention:pass"]


def _streamed(segments: list[Segment], tier: ChunkDiskTier) -> list[Segment]:
    out: list[Segment] = []
    for segment in segments:
        if isinstance(segment, ChunkSegment):
            key = segment.chunk.content_hash
            assert tier.put(key, segment.chunk)
            reader = tier.open_reader(key)
            assert reader is not None
            segment = ChunkSegment(StreamedChunk(reader))
        out.append(segment)
    return out


def _streams(segments: list[Segment]) -> list[StreamedChunk]:
    return [s.chunk for s in segments if isinstance(s, ChunkSegment)]  # type: ignore[misc]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("selector_name", SELECTORS)
@pytest.mark.parametrize("overlap", [True, False])
def test_streamed_chunks_give_the_in_memory_result(
    models: dict, tmp_path: Path, family: str, selector_name: str, overlap: bool
) -> None:
    adapter: HFCausalLMAdapter = models[family]
    segments, _ = _rag_request(adapter)
    selector = selector_of(selector_name, 0.15)
    in_memory = fused_prefill(adapter, segments, selector, return_kv=True)
    streamed = _streamed(segments, ChunkDiskTier(tmp_path, 10**8))
    job = FusionJob(streamed, selector, return_kv=True, overlap_loads=overlap)
    (result,) = fused_prefill_batch(adapter, [job])
    torch.testing.assert_close(result.logits, in_memory.logits, rtol=0, atol=0)
    assert torch.equal(result.selected, in_memory.selected)
    assert result.kv is not None and in_memory.kv is not None
    got_kv = result.kv.keys + result.kv.values
    for got, want in zip(got_kv, in_memory.kv.keys + in_memory.kv.values, strict=True):
        assert torch.equal(got, want)
    # Sparse: at r = 0.15 only the reused rows are read (a check layer reads all rows once).
    # A scoring pass reads every row of the layers it walks, and the prefill after it takes
    # those from memory: no row is read twice.
    streams = _streams(streamed)
    read = sum(s.stats.bytes_read for s in streams)
    dense = sum(s.dense_bytes for s in streams)
    scoring = bool(selector.scoring_layers(adapter.shape.num_layers))
    assert read <= (1.0 if scoring else 0.9) * dense, (read, dense)
    assert result.load_wait_s >= 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_a_streamed_chunk_cut_by_the_exact_prefix_reads_only_its_tail(
    models: dict, tmp_path: Path, family: str
) -> None:
    adapter: HFCausalLMAdapter = models[family]
    segments, ids = _rag_request(adapter)
    prefix = _hf_prefix(adapter, ids[:10])  # ends inside the first chunk (tokens 4..23)
    selector = make_selector("freq", 0.3)
    in_memory = fused_prefill(adapter, segments, selector, exact_prefix=prefix)
    streamed = _streamed(segments, ChunkDiskTier(tmp_path, 10**8))
    result = fused_prefill(adapter, streamed, selector, exact_prefix=prefix)
    torch.testing.assert_close(result.logits, in_memory.logits, rtol=0, atol=0)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_corrupt_row_stops_the_prefill_and_drops_the_chunk(
    models: dict, tmp_path: Path, overlap: bool
) -> None:
    adapter: HFCausalLMAdapter = models["llama"]
    segments, _ = _rag_request(adapter)
    tier = ChunkDiskTier(tmp_path, 10**8)
    streamed = _streamed(segments, tier)
    victim = _streams(streamed)[1]
    key = victim.reader.key
    header = victim.reader.header
    # Flip a byte of a V row in the last layer (read after the compute has started).
    with open(tmp_path / f"{key}.chunk", "r+b") as file:
        offset = header.value_offset(header.num_layers - 1) + 2 * header.value_row_bytes
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0x10]))
    job = FusionJob(streamed, make_selector("freq", 0.0), overlap_loads=overlap)
    with pytest.raises(CorruptChunkError, match=key[:12]):
        fused_prefill_batch(adapter, [job])
    assert key not in tier and tier.stats().corrupt_dropped == 1
    assert not (tmp_path / f"{key}.chunk").exists()


def test_text_only_requests_need_no_loader(models: dict) -> None:
    adapter: HFCausalLMAdapter = models["llama"]
    result = fused_prefill(adapter, [TextSegment((1, 2, 3))], make_selector("freq", 0.15))
    assert result.load_wait_s == 0.0
