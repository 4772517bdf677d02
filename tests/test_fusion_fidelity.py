"""The fidelity techniques of the fusion core against transformers' own forward (tiny models,
fp32): chunks precomputed after a prefix, the question-attention scoring pass, fresh first
layers and APE's tempered question attention; each at ratio 1 still the exact prefill."""

from __future__ import annotations

import pytest
import torch

from sglang_hicache_ext.fusion.adapters.hf import HFCausalLMAdapter
from sglang_hicache_ext.fusion.attention import attend, tempered_context_attention
from sglang_hicache_ext.fusion.executor import FusionJob, fused_prefill
from sglang_hicache_ext.fusion.precompute import precompute_chunk
from sglang_hicache_ext.fusion.request import ChunkSegment, TextSegment
from sglang_hicache_ext.fusion.selectors import (
    QuestionAttentionSelector,
    SelectionContext,
    make_selector,
)
from tests.test_fusion_executor import ATOL, FAMILIES, _hf_attentions, _hf_logits, _ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _hf_cache(adapter: HFCausalLMAdapter, ids: list[int]) -> object:
    with torch.inference_mode():
        return adapter.model(torch.tensor([ids]), use_cache=True).past_key_values


def _rag_request(adapter: HFCausalLMAdapter, prefix: list[int] | None = None) -> tuple[list, list]:
    """prefix | chunk | glue | chunk | question; chunks precomputed after `prefix` if given."""
    ids = _ids(7, 70)
    head = ids[:4] if prefix is None else prefix
    ids = head + ids[4:]
    n = len(head)
    c1 = precompute_chunk(adapter, ids[n : n + 20], prefix_ids=prefix or ())
    c2 = precompute_chunk(adapter, ids[n + 23 : n + 51], prefix_ids=prefix or ())
    segments = [
        TextSegment(tuple(head)),
        ChunkSegment(c1),
        TextSegment(tuple(ids[n + 20 : n + 23])),
        ChunkSegment(c2),
        TextSegment(tuple(ids[n + 51 :]), question=True),
    ]
    return segments, ids


@pytest.mark.parametrize("family", FAMILIES)
def test_chunk_precomputed_after_prefix_holds_that_forward_s_rows(
    models: dict, family: str
) -> None:
    adapter = models[family]
    ids = _ids(21, 40)
    prefix, body = ids[:12], ids[12:]
    chunk = precompute_chunk(adapter, body, prefix_ids=prefix)
    assert chunk.token_ids == tuple(body)
    cache = _hf_cache(adapter, ids)
    for layer in range(adapter.shape.num_layers):
        # HF's cache holds keys after RoPE at their positions; ours before it.
        stored = adapter.rotate(chunk.keys[layer], torch.arange(12, 40), layer)
        torch.testing.assert_close(
            stored, cache.layers[layer].keys[0].transpose(0, 1)[12:], rtol=0, atol=ATOL
        )
        torch.testing.assert_close(
            chunk.values[layer],
            cache.layers[layer].values[0].transpose(0, 1)[12:],
            rtol=0,
            atol=ATOL,
        )
    alone = precompute_chunk(adapter, body)
    assert float((alone.values[1] - chunk.values[1]).abs().max()) > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_conditioned_chunk_served_behind_its_prefix_is_exact(
    models: dict, family: str
) -> None:
    """A chunk precomputed after the prompt's own prefix, served right after it, is what a
    prefix cache would hold: pure reuse gives the full prefill's logits."""
    adapter = models[family]
    ids = _ids(23, 50)
    prefix = ids[:10]
    chunk = precompute_chunk(adapter, ids[10:38], prefix_ids=prefix)
    segments = [
        TextSegment(tuple(prefix)),
        ChunkSegment(chunk),
        TextSegment(tuple(ids[38:]), question=True),
    ]
    reuse = fused_prefill(adapter, segments, make_selector("reuse", 0.0))
    torch.testing.assert_close(reuse.logits, _hf_logits(adapter, ids)[-1], rtol=0, atol=ATOL)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("question_attention", {}),
        ("question_attention", {"fresh_layers": 2, "sink_tokens": 2}),
        ("question_error", {"fresh_layers": 3}),
        ("freq", {"fresh_layers": 1}),
    ],
)
def test_every_technique_at_ratio_one_is_exact(
    models: dict, family: str, name: str, options: dict
) -> None:
    adapter = models[family]
    segments, ids = _rag_request(adapter, prefix=_ids(9, 6))
    result = fused_prefill(adapter, segments, make_selector(name, 1.0, **options))
    torch.testing.assert_close(result.logits, _hf_logits(adapter, ids)[-1], rtol=0, atol=ATOL)


class _Recording(QuestionAttentionSelector):
    def select(self, ctx: SelectionContext) -> torch.Tensor:
        self.recorded = self.score(ctx)
        return super().select(ctx)


@pytest.mark.parametrize("family", FAMILIES)
def test_scoring_pass_is_the_question_attention_over_the_reused_kv(
    models: dict, family: str
) -> None:
    """A chunk at position 0 reused is exact, so the scoring pass's question attention must be
    the model's own attention probabilities, summed over its layers, heads and question rows
    (every question row read: no bound on the read's cost)."""
    adapter = models[family]
    ids = _ids(11, 48)
    chunk = precompute_chunk(adapter, ids[:32])
    segments = [ChunkSegment(chunk), TextSegment(tuple(ids[32:]), question=True)]
    selector = _Recording(0.25, layers=(0.0, 1.0), cost_share=None)
    result = fused_prefill(adapter, segments, selector)
    attentions = _hf_attentions(adapter, ids)
    expected = sum(probs[0][:, 32:, :32].sum(dim=(0, 1)) for probs in attentions)
    torch.testing.assert_close(selector.recorded, expected, rtol=1e-4, atol=1e-5)
    top = torch.sort(torch.topk(expected, 8).indices).values
    assert result.selected.tolist() == top.tolist()
    # The selection was known before layer 0: only the question and the selection computed.
    assert result.computed_tokens == (16 + 8,) * adapter.shape.num_layers


def test_scoring_layers_are_a_fraction_of_the_depth() -> None:
    selector = QuestionAttentionSelector(0.15, layers=(0.25, 0.75))
    assert selector.scoring_layers(24) == tuple(range(6, 18))
    assert selector.scoring_layers(2) == (0, 1)
    assert QuestionAttentionSelector(0.1, layers=(0.9, 1.0)).scoring_layers(4) == (3,)


@pytest.mark.parametrize("family", FAMILIES)
def test_fresh_layers_keep_the_full_prefill_s_kv_then_narrow(models: dict, family: str) -> None:
    adapter = models[family]
    segments, ids = _rag_request(adapter)
    fresh = 2
    result = fused_prefill(
        adapter, segments, make_selector("epic", 0.25, fresh_layers=fresh), return_kv=True
    )
    narrowed = len(ids) - 48 + round(0.25 * 48)
    layers = adapter.shape.num_layers
    assert result.computed_tokens == (len(ids),) * fresh + (narrowed,) * (layers - fresh)
    cache = _hf_cache(adapter, ids)
    assert result.kv is not None
    for layer in range(fresh):
        torch.testing.assert_close(
            result.kv.keys[layer], cache.layers[layer].keys[0].transpose(0, 1), rtol=0, atol=ATOL
        )
    # After them the reused rows are the stored ones, not the full prefill's.
    later = result.kv.keys[fresh] - cache.layers[fresh].keys[0].transpose(0, 1)
    assert float(later.abs().max()) > 1e-3


def _ape_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context: torch.Tensor,
    scale: float,
    temperature: float,
    factor: float,
) -> torch.Tensor:
    """APE's own formulation: attention over the contexts at softmax scale / T and over the
    other keys, merged by their log-sum-exps with the contexts' multiplied by T x S."""
    out = []
    for row in q:  # every key is visible to these queries
        logits = torch.einsum("hd,khd->hk", row, k) * scale
        ctx, other = logits[:, context] / temperature, logits[:, ~context]
        o_ctx = torch.einsum("hk,khd->hd", ctx.softmax(-1), v[context])
        o_other = torch.einsum("hk,khd->hd", other.softmax(-1), v[~context])
        lse = torch.stack([ctx.logsumexp(-1) * temperature * factor, other.logsumexp(-1)], -1)
        weights = lse.softmax(-1)
        out.append(weights[:, :1] * o_ctx + weights[:, 1:] * o_other)
    return torch.stack(out)


@pytest.mark.parametrize(("temperature", "factor"), [(1.0, 1.0), (0.9, 0.9), (0.5, 1.2)])
def test_tempered_attention_is_ape_s(temperature: float, factor: float) -> None:
    generator = torch.Generator().manual_seed(3)
    k = torch.randn(30, 4, 8, generator=generator)
    v = torch.randn(30, 4, 8, generator=generator)
    q = torch.randn(5, 4, 8, generator=generator)
    positions = torch.arange(25, 30)
    context = torch.zeros(30, dtype=torch.bool)
    context[3:20] = True
    got = tempered_context_attention(q, k, v, positions, context, 0.35, temperature, factor)
    # Queries 25..29 see keys up to their own position: the reference on each prefix.
    for i, pos in enumerate(positions.tolist()):
        visible = slice(0, pos + 1)
        expected = _ape_reference(
            q[i : i + 1], k[visible], v[visible], context[visible], 0.35, temperature, factor
        )
        torch.testing.assert_close(got[i : i + 1], expected, rtol=1e-5, atol=1e-5)
    if (temperature, factor) == (1.0, 1.0):
        plain = attend(q, k, v, positions, torch.arange(30), 0.35)
        torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_tempering_changes_only_the_question_and_one_is_identity(models: dict, family: str) -> None:
    adapter = models[family]
    segments, ids = _rag_request(adapter)
    full = make_selector("full", 1.0)
    plain = fused_prefill(adapter, segments, full)
    same = fused_prefill(adapter, segments, full, context_tempering=(1.0, 1.0))
    torch.testing.assert_close(same.logits, plain.logits, rtol=0, atol=0)
    tempered = fused_prefill(adapter, segments, full, context_tempering=(0.9, 0.9))
    assert float((tempered.logits - plain.logits).abs().max()) > 1e-4


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: make_selector("a3", 0.1, fresh_layers=-1), "fresh_layers"),
        (lambda: QuestionAttentionSelector(0.1, layers=(0.5, 0.5)), "scoring layers"),
        (lambda: QuestionAttentionSelector(0.1, layers=(-0.1, 0.5)), "scoring layers"),
        (lambda: FusionJob([], make_selector("reuse", 0.0), context_temperature=0.0), "> 0"),
        (lambda: FusionJob([], make_selector("reuse", 0.0), context_scale=-1.0), "> 0"),
    ],
)
def test_bad_technique_settings_raise(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]
