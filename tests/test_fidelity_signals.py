"""The signals a fused prefill records about its own fidelity (`fusion.fidelity_signals`): off
unless asked, zero deviation where a chunk's context is its own, bounded shares."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_hicache_ext.fusion.executor import fused_prefill, fused_prefill_batch
from sglang_hicache_ext.fusion.precompute import precompute_chunk
from sglang_hicache_ext.fusion.request import ChunkSegment, TextSegment
from sglang_hicache_ext.fusion.request_state import FusionJob
from sglang_hicache_ext.fusion.selectors import make_selector
from tests.test_fusion_executor import _ids, _rag_request

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_no_signals_unless_asked(models: dict) -> None:
    segments, _ = _rag_request(models["llama"])
    assert fused_prefill(models["llama"], segments, make_selector("a3", 0.15)).signals is None


def test_a_chunk_in_its_own_context_deviates_not_one_after_another_does(models: dict) -> None:
    adapter = models["llama"]
    ids = _ids(11, 60)
    first, second = precompute_chunk(adapter, ids[:20]), precompute_chunk(adapter, ids[20:48])
    # The first chunk at position 0 sees exactly what it saw alone; the second sees the first.
    lone = [ChunkSegment(first), TextSegment(tuple(ids[48:]), question=True)]
    job = FusionJob(lone, make_selector("full", 1.0), record_signals=True)
    (result,) = fused_prefill_batch(adapter, [job])
    assert result.signals is not None
    assert result.signals["kv_deviation_l1"] < 1e-5 and result.signals["kv_deviation_l2"] < 1e-5
    pair = [ChunkSegment(first), ChunkSegment(second), TextSegment(tuple(ids[48:]), question=True)]
    job = FusionJob(pair, make_selector("full", 1.0), record_signals=True)
    (result,) = fused_prefill_batch(adapter, [job])
    assert result.signals is not None and result.signals["kv_deviation_l1"] > 1e-3
    assert "kv_deviation_l0" not in result.signals  # layer 0's input is the token alone


@pytest.mark.parametrize("selector_name", ["question_attention", "a3", "reuse"])
def test_signals_of_every_selector_are_bounded(models: dict, selector_name: str) -> None:
    adapter = models["llama"]
    segments, ids = _rag_request(adapter)
    job = FusionJob(segments, make_selector(selector_name, 0.3, sink_tokens=2), record_signals=True)
    (result,) = fused_prefill_batch(adapter, [job])
    signals = result.signals
    assert signals is not None
    assert signals["chunks"] == 2 and signals["chunk_tokens"] == 48
    assert signals["prompt_tokens"] == len(ids) and signals["question_tokens"] == 15
    assert signals["first_token_margin"] >= 0
    assert 0 <= signals["first_token_entropy"] <= math.log(1024) + 1e-4
    # reuse computes no chunk token: nothing to compare
    assert ("kv_deviation_l1" in signals) == (selector_name != "reuse")
    if selector_name == "question_attention":  # only a scoring pass reads the question's mass
        assert 0 < signals["question_chunk_share"] <= 1
        assert 0 <= signals["question_chunk_entropy"] <= 1 + 1e-6
        assert 0.5 <= signals["question_top_chunk_share"] <= 1
    else:
        assert "question_chunk_share" not in signals
    # Recording reads stored rows but changes nothing the prefill computes.
    plain = fused_prefill(adapter, segments, make_selector(selector_name, 0.3, sink_tokens=2))
    assert torch.equal(plain.logits, result.logits)
