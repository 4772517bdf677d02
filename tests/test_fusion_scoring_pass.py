"""The scoring pass of question-aware selectors: what it reads, and what it hands the prefill."""

from __future__ import annotations

import pytest
import torch

from sglang_hicache_ext.fusion.executor import fused_prefill
from sglang_hicache_ext.fusion.request import (
    SCORING_QUESTION_TOKENS,
    TextSegment,
    build_layout,
)
from sglang_hicache_ext.fusion.rope import apply_rope
from sglang_hicache_ext.fusion.selectors import make_selector
from tests.test_fusion_executor import FAMILIES, _ids, _rag_request

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fresh_layers", [0, 2])
def test_prefill_taking_the_scoring_pass_layers_equals_loading_them(
    models: dict, family: str, fresh_layers: int
) -> None:
    """A prefill that returns its KV takes the scoring pass's assembled layers and writes only
    its computed rows (with no fresh layers); one that does not loads and assembles every layer
    itself."""
    adapter = models[family]
    glued, _ = _rag_request(adapter)
    segments = [glued[0], glued[1], glued[3], glued[4]]  # no text between the chunks
    selector = make_selector("question_attention", 0.3, fresh_layers=fresh_layers)
    handed = fused_prefill(adapter, segments, selector, return_kv=True)
    loaded = fused_prefill(adapter, segments, selector)
    assert torch.equal(handed.selected, loaded.selected)
    torch.testing.assert_close(handed.logits, loaded.logits, rtol=0, atol=0)
    # After the fresh layers, the rows not recomputed are the stored ones at their positions.
    assert handed.kv is not None
    for span in build_layout(segments).spans:
        positions = torch.arange(span.start, span.start + span.length)
        reused = ~torch.isin(positions, handed.selected)
        assert reused.any()
        for layer in range(fresh_layers, adapter.shape.num_layers):
            expected = apply_rope(span.chunk.keys[layer], positions, adapter.rope_spec)
            keys = handed.kv.keys[layer]
            torch.testing.assert_close(keys[positions[reused]], expected[reused], rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_scoring_pass_reads_the_chunks_and_the_question_only(models: dict, family: str) -> None:
    """New text between the chunks (computed by the prefill anyway) is left out of the scoring
    pass: the same chunks and question with or without it select the same chunk tokens, and
    the new text is computed at every layer of the prefill all the same."""
    adapter = models[family]
    glued, _ = _rag_request(adapter)
    new_text = TextSegment(tuple(_ids(11, 40)))
    with_new = [glued[0], glued[1], new_text, glued[3], glued[4]]
    without = [glued[0], glued[1], glued[3], glued[4]]
    selector = make_selector("question_attention", 0.3)
    fused = [fused_prefill(adapter, segments, selector) for segments in (with_new, without)]
    chunk_rank = [
        torch.searchsorted(build_layout(segments).chunk_positions, result.selected)
        for segments, result in zip((with_new, without), fused, strict=True)
    ]
    assert chunk_rank[0].numel() > 0
    assert torch.equal(chunk_rank[0], chunk_rank[1])
    extra = len(new_text.token_ids)
    assert [a - b for a, b in zip(*(r.computed_tokens for r in fused), strict=True)] == [
        extra
    ] * adapter.shape.num_layers


@pytest.mark.parametrize("family", FAMILIES)
def test_scoring_pass_reads_the_end_of_a_long_question(models: dict, family: str) -> None:
    """Text after the last chunk is the question when none is marked; when it is longer than
    SCORING_QUESTION_TOKENS (new paragraphs before the question) the scoring pass reads its
    end only: the selection is that of the same chunks followed by those last tokens alone,
    and the prefill computes the whole tail at every layer."""
    adapter = models[family]
    glued, _ = _rag_request(adapter)
    tail = tuple(_ids(13, SCORING_QUESTION_TOKENS + 50))
    long_tail = [*glued[:4], TextSegment(tail)]
    its_end = [*glued[:4], TextSegment(tail[-SCORING_QUESTION_TOKENS:])]
    assert int(build_layout(long_tail).is_question.sum()) == len(tail)
    selector = make_selector("question_attention", 0.3)
    fused = [fused_prefill(adapter, segments, selector) for segments in (long_tail, its_end)]
    assert fused[0].selected.numel() > 0
    assert torch.equal(fused[0].selected, fused[1].selected)
    assert [a - b for a, b in zip(*(r.computed_tokens for r in fused), strict=True)] == [
        50
    ] * adapter.shape.num_layers
