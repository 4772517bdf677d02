"""Fused prefill against transformers' own forward on the tiny Llama and Qwen2 models (fp32)."""

from __future__ import annotations

import pytest
import torch

from sglang_hicache_ext.fusion.adapters.hf import HFCausalLMAdapter
from sglang_hicache_ext.fusion.attention import attend, position_causal_attention
from sglang_hicache_ext.fusion.chunk import PrecomputedChunk
from sglang_hicache_ext.fusion.decoding import generate_greedy
from sglang_hicache_ext.fusion.executor import (
    FusionJob,
    KVCache,
    fused_prefill,
    fused_prefill_batch,
)
from sglang_hicache_ext.fusion.frequency import frequency_scores, layer_frequency_scores, low_pass
from sglang_hicache_ext.fusion.precompute import precompute_chunk
from sglang_hicache_ext.fusion.request import ChunkSegment, TextSegment, build_layout
from sglang_hicache_ext.fusion.rope import apply_rope
from sglang_hicache_ext.fusion.selectors import (
    A3Selector,
    SelectionContext,
    Selector,
    make_selector,
)
from sglang_hicache_ext.tiers.chunks.chunk_tensors import tensor_bytes

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = ["llama", "qwen2"]
ATOL = 1e-4
# Batched requests: one matrix product for all rows reorders fp32 sums (GEMM blocking depends on
# the row count), so results equal one-by-one runs within fp32 noise, not bit for bit (measured
# at most 1.2e-7 on the tiny models' logits).
BATCH_ATOL = 1e-5


def selector_of(spec: str, ratio: float, **options: object) -> Selector:
    """`<selector>` or `question_attention:pass`: the default selector scoring by its pass
    whatever the request (these tiny requests save too little to afford the pass, and would
    be scored inline)."""
    name, _, mode = spec.partition(":")
    if mode == "pass":
        options["inline_layers"] = None
    return make_selector(name, ratio, **options)


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(adapter: HFCausalLMAdapter, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return adapter.model(torch.tensor([ids])).logits[0].float()


def _hf_attentions(adapter: HFCausalLMAdapter, ids: list[int]) -> tuple[torch.Tensor, ...]:
    """transformers' own attention probabilities per layer ([1, heads, query, key])."""
    model = adapter.model
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            return model(torch.tensor([ids]), output_attentions=True).attentions
    finally:
        model.set_attn_implementation("sdpa")


def _hf_greedy(adapter: HFCausalLMAdapter, ids: list[int], steps: int) -> list[int]:
    ids = list(ids)
    out = []
    for _ in range(steps):
        token = int(_hf_logits(adapter, ids)[-1].argmax())
        out.append(token)
        ids.append(token)
    return out


def _rag_request(adapter: HFCausalLMAdapter) -> tuple[list, list[int]]:
    """glue | chunk | glue | chunk | question, with the flat token ids."""
    ids = _ids(7, 70)
    c1 = precompute_chunk(adapter, ids[4:24])
    c2 = precompute_chunk(adapter, ids[27:55])
    segments = [
        TextSegment(tuple(ids[:4])),
        ChunkSegment(c1),
        TextSegment(tuple(ids[24:27])),
        ChunkSegment(c2),
        TextSegment(tuple(ids[55:]), question=True),
    ]
    return segments, ids


@pytest.mark.parametrize("family", FAMILIES)
def test_full_equals_hf_forward_and_greedy(models: dict, family: str) -> None:
    adapter = models[family]
    segments, ids = _rag_request(adapter)
    result = generate_greedy(adapter, segments, make_selector("full", 1.0), max_new_tokens=5)
    reference = _hf_logits(adapter, ids)[-1]
    torch.testing.assert_close(result.first_logits, reference, rtol=0, atol=ATOL)
    assert list(result.token_ids) == _hf_greedy(adapter, ids, 5)
    assert result.prefill.computed_tokens == (len(ids),) * adapter.shape.num_layers


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", ["a3", "cacheblend", "freq", "epic", "random"])
def test_any_selector_at_ratio_one_is_exact(models: dict, family: str, name: str) -> None:
    adapter = models[family]
    segments, ids = _rag_request(adapter)
    result = fused_prefill(adapter, segments, make_selector(name, 1.0))
    torch.testing.assert_close(result.logits, _hf_logits(adapter, ids)[-1], rtol=0, atol=ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunk_at_position_zero_with_reuse_equals_prefix_cache(models: dict, family: str) -> None:
    adapter = models[family]
    ids = _ids(11, 48)
    chunk = precompute_chunk(adapter, ids[:32])
    segments = [ChunkSegment(chunk), TextSegment(tuple(ids[32:]), question=True)]
    result = generate_greedy(adapter, segments, make_selector("reuse", 0.0), max_new_tokens=4)
    # Only the 16 question tokens were computed at every layer: the chunk was pure reuse.
    assert result.prefill.computed_tokens == (16,) * adapter.shape.num_layers
    torch.testing.assert_close(result.first_logits, _hf_logits(adapter, ids)[-1], rtol=0, atol=ATOL)
    assert list(result.token_ids) == _hf_greedy(adapter, ids, 4)
    # The reused KV is the KV a normal forward writes (what a prefix cache would hold).
    with torch.inference_mode():
        cache = adapter.model(torch.tensor([ids]), use_cache=True).past_key_values
    kv = result.prefill.kv
    assert kv is not None
    for layer in range(adapter.shape.num_layers):
        hf_k = cache.layers[layer].keys[0].transpose(0, 1)
        torch.testing.assert_close(kv.keys[layer], hf_k, rtol=0, atol=ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_non_prefix_reuse_is_approximate_and_computes_only_text(models: dict, family: str) -> None:
    adapter = models[family]
    segments, ids = _rag_request(adapter)
    reuse = fused_prefill(adapter, segments, make_selector("reuse", 0.0))
    reference = _hf_logits(adapter, ids)[-1]
    # Chunk 2 missed its cross-attention to chunk 1 and the glue: the logits must differ.
    assert float((reuse.logits - reference).abs().max()) > 1e-3
    text_tokens = len(ids) - 20 - 28
    assert reuse.computed_tokens == (text_tokens,) * adapter.shape.num_layers


@pytest.mark.parametrize("family", FAMILIES)
def test_check_layer_selectors_compute_all_then_narrow(models: dict, family: str) -> None:
    adapter = models[family]
    segments, ids = _rag_request(adapter)
    result = fused_prefill(adapter, segments, make_selector("a3", 0.25))
    narrowed = len(ids) - 48 + round(0.25 * 48)
    assert result.computed_tokens == (len(ids), len(ids)) + (narrowed,) * (
        adapter.shape.num_layers - 2
    )


class _RecordingA3(A3Selector):
    def select(self, ctx: SelectionContext) -> torch.Tensor:
        self.recorded = self.score(ctx)
        return super().select(ctx)


@pytest.mark.parametrize("family", FAMILIES)
def test_a3_scores_are_question_attention_at_layer_one(models: dict, family: str) -> None:
    adapter = models[family]
    segments, ids = _rag_request(adapter)
    selector = _RecordingA3(0.2)
    fused_prefill(adapter, segments, selector)
    attentions = _hf_attentions(adapter, ids)
    probs = attentions[1][0]  # [heads, query, key]
    chunk_cols = list(range(4, 24)) + list(range(27, 55))
    expected = probs[:, 55:, :].sum(dim=(0, 1))[chunk_cols]
    torch.testing.assert_close(selector.recorded, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_precomputed_keys_are_pre_rope(models: dict, family: str) -> None:
    adapter = models[family]
    ids = _ids(3, 24)
    chunk = precompute_chunk(adapter, ids)
    assert tuple(chunk.freq_scores.shape) == (adapter.shape.num_layers, 24)
    with torch.inference_mode():
        cache = adapter.model(torch.tensor([ids]), use_cache=True).past_key_values
    positions = torch.arange(24)
    for layer in range(adapter.shape.num_layers):
        hf_k = cache.layers[layer].keys[0].transpose(0, 1)
        rotated = apply_rope(chunk.keys[layer], positions, adapter.rope_spec)
        torch.testing.assert_close(rotated, hf_k, rtol=0, atol=ATOL)
        hf_v = cache.layers[layer].values[0].transpose(0, 1)
        torch.testing.assert_close(chunk.values[layer], hf_v, rtol=0, atol=ATOL)
        expected = frequency_scores(chunk.keys[layer], chunk.values[layer], chunk.alpha)
        torch.testing.assert_close(chunk.freq_scores[layer], expected)


def test_frequency_scores_low_pass() -> None:
    torch.manual_seed(0)
    k, v = torch.randn(33, 2, 8), torch.randn(33, 2, 8)
    # alpha = 1 keeps every frequency: scores are the plain per-token norms.
    plain = 0.5 * (k.flatten(1).norm(dim=-1) + v.flatten(1).norm(dim=-1))
    torch.testing.assert_close(frequency_scores(k, v, alpha=1.0), plain, rtol=1e-5, atol=1e-5)
    # A constant sequence is pure DC: the low-pass keeps it whole.
    const = torch.ones(16, 1, 4) * 3.0
    torch.testing.assert_close(low_pass(const, 0.5), const, rtol=1e-6, atol=1e-6)
    # A Nyquist-rate alternation is removed entirely.
    alt = torch.tensor([1.0, -1.0] * 8)[:, None, None]
    assert float(low_pass(alt, 0.5).abs().max()) < 1e-6
    with pytest.raises(ValueError, match="alpha"):
        low_pass(const, 0.0)


def test_attend_backends_on_cpu() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    q_pos, k_pos = torch.tensor([2, 5, 9]), torch.arange(10)
    expected = position_causal_attention(q, k, v, q_pos, k_pos)
    torch.testing.assert_close(attend(q, k, v, q_pos, k_pos, backend="auto"), expected)
    with pytest.raises(ValueError, match="flashinfer"):
        attend(q, k, v, q_pos, k_pos, backend="flashinfer")
    with pytest.raises(ValueError, match="backend"):
        attend(q, k, v, q_pos, k_pos, backend="triton")


@pytest.mark.parametrize("family", FAMILIES)
def test_selected_rows_are_never_loaded(models: dict, family: str) -> None:
    adapter = models[family]
    segments, _ = _rag_request(adapter)
    selector = make_selector("freq", 0.3)
    clean = fused_prefill(adapter, segments, selector)
    # Poison the stored KV of the rows freq recomputes: a sparse load never reads them.
    poisoned = []
    for segment in segments:
        if isinstance(segment, ChunkSegment):
            chunk = segment.chunk
            start = next(s.start for s in build_layout(segments).spans if s.chunk is chunk)
            rows = (
                clean.selected[
                    (clean.selected >= start) & (clean.selected < start + len(chunk.token_ids))
                ]
                - start
            )
            assert rows.numel() > 0
            keys = tuple(k.clone().index_fill_(0, rows, float("nan")) for k in chunk.keys)
            values = tuple(v.clone().index_fill_(0, rows, float("nan")) for v in chunk.values)
            segment = ChunkSegment(
                PrecomputedChunk(chunk.token_ids, keys, values, chunk.freq_scores)
            )
        poisoned.append(segment)
    result = fused_prefill(adapter, poisoned, selector)
    assert torch.isfinite(result.logits).all()
    torch.testing.assert_close(result.logits, clean.logits, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_request_ending_in_chunk_and_text_only(models: dict, family: str) -> None:
    adapter = models[family]
    ids = _ids(13, 40)
    chunk = precompute_chunk(adapter, ids[10:])
    segments = [TextSegment(tuple(ids[:10])), ChunkSegment(chunk)]
    reuse = fused_prefill(adapter, segments, make_selector("reuse", 0.0))
    # The last token is always computed, even inside a chunk, to give the next-token logits.
    assert reuse.computed_tokens == (11,) * adapter.shape.num_layers
    full = fused_prefill(adapter, segments, make_selector("full", 1.0))
    torch.testing.assert_close(full.logits, _hf_logits(adapter, ids)[-1], rtol=0, atol=ATOL)
    text_only = fused_prefill(adapter, [TextSegment(tuple(ids))], make_selector("a3", 0.5))
    assert text_only.selected.numel() == 0
    torch.testing.assert_close(text_only.logits, _hf_logits(adapter, ids)[-1], rtol=0, atol=ATOL)


def _hf_prefix(adapter: HFCausalLMAdapter, ids: list[int]) -> KVCache:
    """The KV a normal forward of `ids` leaves (what a prefix-tree hit holds), post-RoPE."""
    with torch.inference_mode():
        cache = adapter.model(torch.tensor([ids]), use_cache=True).past_key_values
    layers = range(adapter.shape.num_layers)
    return KVCache(
        tuple(cache.layers[i].keys[0].transpose(0, 1).contiguous() for i in layers),
        tuple(cache.layers[i].values[0].transpose(0, 1).contiguous() for i in layers),
    )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prefix_len", [10, 24, 60])
def test_exact_prefix_is_neither_computed_nor_queried(
    models: dict, family: str, prefix_len: int
) -> None:
    # 10 ends inside the first chunk (4..24), 24 at its end, 60 inside the question.
    adapter = models[family]
    segments, ids = _rag_request(adapter)
    prefix = _hf_prefix(adapter, ids[:prefix_len])
    reference = _hf_logits(adapter, ids)[-1]
    for name in ("full", "a3", "cacheblend"):
        result = fused_prefill(
            adapter, segments, make_selector(name, 1.0), exact_prefix=prefix, return_kv=True
        )
        torch.testing.assert_close(result.logits, reference, rtol=0, atol=ATOL)
        assert result.computed_tokens == (len(ids) - prefix_len,) * adapter.shape.num_layers
        assert result.prefix_tokens == prefix_len and result.kv is not None
        assert torch.equal(result.kv.keys[3][:prefix_len], prefix.keys[3])
    # Only chunk tokens after the prefix are chosen from: a chunk it covers in part starts there.
    partial = fused_prefill(adapter, segments, make_selector("a3", 0.25), exact_prefix=prefix)
    chunk_tokens = sum(max(0, end - max(start, prefix_len)) for start, end in ((4, 24), (27, 55)))
    assert partial.num_chunk_tokens == chunk_tokens
    assert partial.selected.numel() == round(0.25 * chunk_tokens)
    assert bool((partial.selected >= prefix_len).all())


@pytest.mark.parametrize("family", FAMILIES)
def test_outputs_from_are_computed_at_every_layer(models: dict, family: str) -> None:
    adapter = models[family]
    segments, ids = _rag_request(adapter)
    full = fused_prefill(adapter, segments, make_selector("full", 1.0), outputs_from=30)
    assert full.hidden is not None and full.hidden.shape[0] == len(ids) - 30
    # The hidden states are the last layer's output before the final norm: the LM head over
    # them gives the normal forward's logits at every one of those positions.
    torch.testing.assert_close(
        adapter.logits(full.hidden), _hf_logits(adapter, ids)[30:], rtol=0, atol=ATOL
    )
    reuse = fused_prefill(adapter, segments, make_selector("reuse", 0.0), outputs_from=30)
    # Text tokens (4 + 3 + 15) plus chunk-2 tokens 30..54 at every layer.
    assert reuse.computed_tokens == (4 + 3 + 15 + 25,) * adapter.shape.num_layers
    with pytest.raises(ValueError, match="outputs_from"):
        fused_prefill(
            adapter,
            segments,
            make_selector("full", 1.0),
            exact_prefix=_hf_prefix(adapter, ids[:20]),
            outputs_from=10,
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_equals_one_by_one(models: dict, family: str) -> None:
    adapter = models[family]
    segments, ids = _rag_request(adapter)
    other_ids = _ids(21, 40)
    other = [
        TextSegment(tuple(other_ids[:6])),
        ChunkSegment(precompute_chunk(adapter, other_ids[6:30])),
        TextSegment(tuple(other_ids[30:]), question=True),
    ]
    jobs = [
        FusionJob(segments, make_selector("a3", 0.25), return_kv=True),
        FusionJob(other, make_selector("reuse", 0.0), outputs_from=35),
        FusionJob(
            segments, make_selector("cacheblend", 0.3), exact_prefix=_hf_prefix(adapter, ids[:10])
        ),
        FusionJob(other, make_selector("epic", 0.5), return_kv=True),
    ]
    batched = fused_prefill_batch(adapter, jobs)
    for job, together in zip(jobs, batched, strict=True):
        alone = fused_prefill_batch(adapter, [job])[0]
        assert torch.equal(together.selected, alone.selected)
        assert together.computed_tokens == alone.computed_tokens
        torch.testing.assert_close(together.logits, alone.logits, rtol=0, atol=BATCH_ATOL)
        if alone.hidden is not None:
            torch.testing.assert_close(together.hidden, alone.hidden, rtol=0, atol=BATCH_ATOL)
        if alone.kv is not None:
            assert together.kv is not None
            for mine, theirs in zip(together.kv.keys, alone.kv.keys, strict=True):
                torch.testing.assert_close(mine, theirs, rtol=0, atol=BATCH_ATOL)


@pytest.mark.parametrize("tokens", [1, 7, 64, 1100])  # 1100: past the projection, by FFT
def test_scores_of_every_layer_at_once_equal_the_per_layer_scores(tokens: int) -> None:
    generator = torch.Generator().manual_seed(tokens)
    keys = [torch.randn(tokens, 2, 8, generator=generator).bfloat16() for _ in range(5)]
    values = [torch.randn(tokens, 2, 8, generator=generator).bfloat16() for _ in range(5)]
    per_layer = torch.stack([frequency_scores(k, v) for k, v in zip(keys, values, strict=True)])
    at_once = layer_frequency_scores(keys, values)
    torch.testing.assert_close(at_once, per_layer)
    assert at_once.stride() == per_layer.stride()  # stored files take the bytes row-major
    assert len(tensor_bytes(at_once)) == 4 * 5 * tokens
