"""The scoring pass of question-aware selectors: what it reads, and what it hands the prefill."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from sglang_hicache_ext.fusion.adapters.hf import HFCausalLMAdapter
from sglang_hicache_ext.fusion.executor import FusionJob, fused_prefill, fused_prefill_batch
from sglang_hicache_ext.fusion.precompute import precompute_chunk
from sglang_hicache_ext.fusion.request import (
    SCORING_COST_SHARE,
    SCORING_MIN_QUESTION_TOKENS,
    SCORING_QUESTION_TOKENS,
    ChunkSegment,
    TextSegment,
    build_layout,
)
from sglang_hicache_ext.fusion.rope import apply_rope
from sglang_hicache_ext.fusion.selectors import make_selector, top_k
from tests.test_fusion_executor import (
    BATCH_ATOL,
    FAMILIES,
    _hf_attentions,
    _ids,
    _rag_request,
    selector_of,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@contextmanager
def _walks_counted(adapter: HFCausalLMAdapter) -> Iterator[list[int]]:
    """The rows each walk of the layers starts with (one embedding call per walk)."""
    walks: list[int] = []
    embed = adapter.embed

    def counted(token_ids: torch.Tensor) -> torch.Tensor:
        walks.append(int(token_ids.numel()))
        return embed(token_ids)

    adapter.embed = counted  # type: ignore[method-assign]
    try:
        yield walks
    finally:
        del adapter.embed


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
    selector = selector_of("question_attention:pass", 0.3, fresh_layers=fresh_layers)
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
    selector = selector_of("question_attention:pass", 0.3)
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
    selector = selector_of("question_attention:pass", 0.3)
    fused = [fused_prefill(adapter, segments, selector) for segments in (long_tail, its_end)]
    assert fused[0].selected.numel() > 0
    assert torch.equal(fused[0].selected, fused[1].selected)
    assert [a - b for a, b in zip(*(r.computed_tokens for r in fused), strict=True)] == [
        50
    ] * adapter.shape.num_layers


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk_tokens", [40, 600])
def test_scoring_read_costs_at_most_its_share_of_what_reuse_saves(
    models: dict, family: str, chunk_tokens: int
) -> None:
    """A request that reuses few chunk tokens saves little: its scoring pass reads only as many
    of the question's last tokens as cost SCORING_COST_SHARE of the token-layers reuse skips
    (never fewer than SCORING_MIN_QUESTION_TOKENS), and selects exactly as an unbounded pass
    reading that many would."""
    adapter = models[family]
    ids = _ids(17, chunk_tokens + SCORING_QUESTION_TOKENS)
    chunk = precompute_chunk(adapter, ids[:chunk_tokens])
    segments = [ChunkSegment(chunk), TextSegment(tuple(ids[chunk_tokens:]))]
    layout = build_layout(segments)
    bounded = selector_of("question_attention:pass", 0.3)
    num_layers = adapter.shape.num_layers
    skipped_layers = (layout.num_chunk_tokens - bounded.budget(layout)) * num_layers
    pass_layers = max(bounded.scoring_layers(num_layers)) + 1
    affordable = int(SCORING_COST_SHARE * skipped_layers / pass_layers)
    read = max(SCORING_MIN_QUESTION_TOKENS, affordable)
    assert read < SCORING_QUESTION_TOKENS
    assert (read == SCORING_MIN_QUESTION_TOKENS) == (chunk_tokens == 40)
    assert bounded.scoring_question_read(layout, num_layers) == read
    unbounded = make_selector("question_attention", 0.3, question_tokens=read, cost_share=None)
    fused = [fused_prefill(adapter, segments, s) for s in (bounded, unbounded)]
    assert fused[0].selected.numel() > 0
    assert torch.equal(fused[0].selected, fused[1].selected)
    torch.testing.assert_close(fused[0].logits, fused[1].logits, rtol=0, atol=0)
    # A full read selects otherwise: the bound is what chose these tokens.
    full_read = fused_prefill(
        adapter, segments, make_selector("question_attention", 0.3, cost_share=None)
    )
    assert not torch.equal(full_read.selected, fused[0].selected)


@pytest.mark.parametrize("family", FAMILIES)
def test_no_scoring_pass_when_first_tokens_fill_the_budget(models: dict, family: str) -> None:
    """When each chunk's first `sink_tokens` fill the budget the scores choose nothing: no
    scoring pass runs (one walk of the layers, only the selection and the text computed), and
    the answer is the one computed with it."""
    adapter = models[family]
    segments, _ = _rag_request(adapter)
    selector = make_selector("question_attention", 0.3, sink_tokens=8)
    layout = build_layout(segments)
    assert 0 < selector.budget(layout) <= 16 and not selector.scores_decide(layout)
    with _walks_counted(adapter) as walks:
        plain = fused_prefill(adapter, segments, selector)
        assert len(walks) == 1
        # The fidelity signals come from the scoring pass: asked for, it still runs.
        (scored,) = fused_prefill_batch(
            adapter, [FusionJob(segments, selector, record_signals=True)]
        )
    assert len(walks) == 3
    first = torch.cat([torch.arange(s.start, s.start + 8) for s in layout.spans])
    assert torch.equal(plain.selected, first[: selector.budget(layout)])
    assert torch.equal(plain.selected, scored.selected)
    text = layout.num_tokens - layout.num_chunk_tokens
    assert plain.computed_tokens == (text + selector.budget(layout),) * adapter.shape.num_layers
    torch.testing.assert_close(plain.logits, scored.logits, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_inline_scoring_selects_what_the_question_reads_in_the_prefill(
    models: dict, family: str
) -> None:
    """A request whose reuse cannot afford the scoring pass's smallest read has, with inline
    layers, its question's attention measured inside the prefill: no pass (one walk of the
    layers), every token computed up to the last inline layer and only the text and the
    selection after it, and the selection is the chunk tokens the question's last
    SCORING_QUESTION_TOKENS attend to most at those layers in transformers' own forward of the
    whole prompt (exact KV there). A request whose reuse affords the pass keeps it, and both
    batched together select as each does alone."""
    adapter = models[family]
    num_layers = adapter.shape.num_layers
    question = SCORING_QUESTION_TOKENS + 30  # longer than the rows that count
    ids = _ids(17, 40 + question)
    segments = [
        ChunkSegment(precompute_chunk(adapter, ids[:40])),
        TextSegment(tuple(ids[40:])),
    ]
    layout = build_layout(segments)
    selector = make_selector("question_attention", 0.3)  # inline layers by default
    inline = selector.inline_scoring_layers(layout, num_layers)
    assert inline and max(inline) < num_layers - 1
    with _walks_counted(adapter) as walks:
        fused = fused_prefill(adapter, segments, selector)
    assert walks == [layout.num_tokens]
    budget = selector.budget(layout)
    narrow = (question + budget,) * (num_layers - max(inline) - 1)
    assert fused.computed_tokens == (layout.num_tokens,) * (max(inline) + 1) + narrow
    attentions = _hf_attentions(adapter, ids)
    last = slice(layout.num_tokens - SCORING_QUESTION_TOKENS, None)
    scores = sum(attentions[layer][0, :, last, :40].sum(dim=(0, 1)) for layer in inline)
    assert torch.equal(fused.selected, torch.sort(top_k(scores, budget)).values)

    long_ids = _ids(18, 600 + SCORING_QUESTION_TOKENS)
    long_chunk = [ChunkSegment(precompute_chunk(adapter, long_ids[:600])), segments[1]]
    assert selector.inline_scoring_layers(build_layout(long_chunk), num_layers) == ()
    alone = fused_prefill(adapter, long_chunk, selector)
    jobs = [FusionJob(segments, selector), FusionJob(long_chunk, selector)]
    batched = fused_prefill_batch(adapter, jobs)
    for one, together in zip((fused, alone), batched, strict=True):
        assert torch.equal(one.selected, together.selected)
        torch.testing.assert_close(one.logits, together.logits, rtol=0, atol=BATCH_ATOL)
