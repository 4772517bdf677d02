"""Chunks held in host memory (`fusion.host_chunk`) give the fused prefill of the same chunks in
memory, bit for bit: read a layer ahead or at the point of use, whole layers or only the rows
reused, for every kind of selector. On the CPU the reads are the GPU's minus pinning and the
copy stream (benchmarks/fusion_gpu.py measures those on a GPU)."""

from __future__ import annotations

import pytest
import torch

from sglang_hicache_ext.fusion.chunk import PrecomputedChunk
from sglang_hicache_ext.fusion.executor import fused_prefill, fused_prefill_batch
from sglang_hicache_ext.fusion.host_chunk import HostChunk
from sglang_hicache_ext.fusion.request import ChunkSegment, Segment
from sglang_hicache_ext.fusion.request_state import FusionJob
from tests.test_fusion_executor import _rag_request, selector_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# freq selects before the first layer; a3 at its check layer (reads every row there);
# question_attention inline on these small requests, and after a scoring pass that reads every
# row of its layers (":pass").
SELECTORS = ["freq", "a3", "question_attention", "question_attention:pass"]


def _held(segments: list[Segment], dense_above: float) -> list[Segment]:
    return [
        ChunkSegment(HostChunk.hold(s.chunk, "cpu", dense_above))  # type: ignore[arg-type]
        if isinstance(s, ChunkSegment)
        else s
        for s in segments
    ]


@pytest.mark.parametrize("selector_name", SELECTORS)
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("dense_above", [0.0, 1.0])
def test_host_chunks_give_the_in_memory_result(
    models: dict, selector_name: str, overlap: bool, dense_above: float
) -> None:
    adapter = models["llama"]
    segments, _ = _rag_request(adapter)
    selector = selector_of(selector_name, 0.15, sink_tokens=2)
    in_memory = fused_prefill(adapter, segments, selector, return_kv=True)
    held = _held(segments, dense_above)
    assert not any(s.chunk.in_memory for s in held if isinstance(s, ChunkSegment))
    job = FusionJob(held, selector, return_kv=True, overlap_loads=overlap)
    (result,) = fused_prefill_batch(adapter, [job])
    assert torch.equal(result.logits, in_memory.logits)
    assert torch.equal(result.selected, in_memory.selected)
    assert result.kv is not None and in_memory.kv is not None
    for got, want in zip(
        result.kv.keys + result.kv.values, in_memory.kv.keys + in_memory.kv.values, strict=True
    ):
        assert torch.equal(got, want)


def test_a_slice_reads_the_rows_of_its_range(models: dict) -> None:
    segments, _ = _rag_request(models["llama"])
    chunk = next(s.chunk for s in segments if isinstance(s, ChunkSegment))
    assert isinstance(chunk, PrecomputedChunk)
    held = HostChunk.hold(chunk, "cpu").slice(2, 6)
    rows = torch.tensor([0, 3])
    k, v = held.rows(1, rows)
    assert torch.equal(k, chunk.keys[1][[2, 5]]) and torch.equal(v, chunk.values[1][[2, 5]])
    assert held.token_ids == chunk.token_ids[2:6] and held.num_tokens == 4


def test_dense_share_out_of_range_is_refused(models: dict) -> None:
    segments, _ = _rag_request(models["llama"])
    chunk = next(s.chunk for s in segments if isinstance(s, ChunkSegment))
    assert isinstance(chunk, PrecomputedChunk)
    with pytest.raises(ValueError, match=r"dense_above must be in \[0, 1\]"):
        HostChunk.hold(chunk, "cpu", dense_above=1.5)
