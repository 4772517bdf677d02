"""Selectors: selector x model family x ratio, and every bad input rejected with ValueError."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from sglang_hicache_ext.fusion.adapters.hf import HFCausalLMAdapter
from sglang_hicache_ext.fusion.chunk import PrecomputedChunk
from sglang_hicache_ext.fusion.executor import fused_prefill
from sglang_hicache_ext.fusion.precompute import precompute_chunk
from sglang_hicache_ext.fusion.request import ChunkSegment, TextSegment, build_layout
from sglang_hicache_ext.fusion.selectors import SELECTORS, make_selector

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = ["llama", "qwen2"]
RATIOS = [0.0, 0.1, 0.37, 1.0]
CHUNK_LENGTHS = (7, 19, 30)


@pytest.fixture(scope="module")
def requests(tiny_llama_path: Path, tiny_qwen2_path: Path) -> dict:
    """Per family: the adapter and a request glue | 3 chunks of different lengths | question."""
    out = {}
    for family, path in {"llama": tiny_llama_path, "qwen2": tiny_qwen2_path}.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        adapter = HFCausalLMAdapter(model)
        ids = torch.randint(0, 1024, (80,), generator=torch.Generator().manual_seed(5)).tolist()
        segments: list = [TextSegment(tuple(ids[:3]))]
        start = 3
        for length in CHUNK_LENGTHS:
            segments.append(ChunkSegment(precompute_chunk(adapter, ids[start : start + length])))
            segments.append(TextSegment(tuple(ids[start + length : start + length + 2])))
            start += length + 2
        segments[-1] = TextSegment(tuple(ids[start - 2 : start + 10]), question=True)
        out[family] = (adapter, segments)
    return out


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_selection_count_and_validity(requests: dict, name: str, family: str, ratio: float) -> None:
    adapter, segments = requests[family]
    layout = build_layout(segments)
    total = layout.num_chunk_tokens
    result = fused_prefill(adapter, segments, make_selector(name, ratio))
    selected = result.selected.tolist()
    expected = {"reuse": 0, "full": total}.get(name, round(ratio * total))
    assert len(selected) == expected
    assert len(set(selected)) == len(selected)
    assert selected == sorted(selected)
    assert all(bool(layout.is_chunk[p]) for p in selected)
    if name == "full":
        assert selected == layout.chunk_positions.tolist()
    if name in ("epic", "freq"):
        # Per-chunk selectors share the budget out by chunk length, never beyond a chunk.
        per_chunk = [sum(s.start <= p < s.start + s.length for p in selected) for s in layout.spans]
        exact = [expected * s.length / total for s in layout.spans]
        assert all(
            math.floor(e) <= c <= math.ceil(e) for c, e in zip(per_chunk, exact, strict=True)
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_epic_takes_chunk_heads_and_freq_takes_top_scores(requests: dict, family: str) -> None:
    adapter, segments = requests[family]
    layout = build_layout(segments)
    epic = fused_prefill(adapter, segments, make_selector("epic", 0.37)).selected.tolist()
    freq = fused_prefill(adapter, segments, make_selector("freq", 0.37)).selected.tolist()
    for span in layout.spans:
        local_epic = [p - span.start for p in epic if span.start <= p < span.start + span.length]
        assert local_epic == list(range(len(local_epic)))
        local_freq = [p - span.start for p in freq if span.start <= p < span.start + span.length]
        top = torch.topk(span.chunk.freq_scores.mean(0), len(local_freq)).indices
        assert sorted(local_freq) == sorted(top.tolist())


@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_single_chunk_count(requests: dict, name: str) -> None:
    adapter, segments = requests["llama"]
    chunk = segments[1].chunk
    request = [ChunkSegment(chunk), TextSegment((1, 2, 3), question=True)]
    result = fused_prefill(adapter, request, make_selector(name, 0.5))
    expected = {"reuse": 0, "full": chunk.num_tokens}.get(name, round(0.5 * chunk.num_tokens))
    assert result.selected.numel() == expected


@pytest.mark.parametrize("name", ["a3", "cacheblend", "freq", "random"])
def test_sink_tokens_come_first_within_budget(requests: dict, name: str) -> None:
    adapter, segments = requests["llama"]
    layout = build_layout(segments)
    result = fused_prefill(adapter, segments, make_selector(name, 0.25, sink_tokens=2))
    selected = set(result.selected.tolist())
    assert len(selected) == round(0.25 * layout.num_chunk_tokens)
    assert all({s.start, s.start + 1} <= selected for s in layout.spans)
    with pytest.raises(ValueError, match="sink_tokens"):
        make_selector(name, 0.25, sink_tokens=-1)


def test_random_is_seeded() -> None:
    layout = build_layout([TextSegment((1,)), ChunkSegment(_fake_chunk(50)), TextSegment((2,))])
    from sglang_hicache_ext.fusion.selectors import SelectionContext

    a = make_selector("random", 0.3, seed=1).select(SelectionContext(layout))
    b = make_selector("random", 0.3, seed=1).select(SelectionContext(layout))
    c = make_selector("random", 0.3, seed=2).select(SelectionContext(layout))
    assert a.tolist() == b.tolist() and a.tolist() != c.tolist()


@pytest.mark.parametrize("ratio", [-0.1, 1.5, float("nan")])
@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_ratio_outside_unit_interval_raises(name: str, ratio: float) -> None:
    with pytest.raises(ValueError, match="ratio"):
        make_selector(name, ratio)
    with pytest.raises(ValueError, match="ratio"):
        SELECTORS[name](ratio)


def test_unknown_selector_raises() -> None:
    with pytest.raises(ValueError, match="unknown selector 'snapkv'"):
        make_selector("snapkv", 0.2)


def test_empty_chunk_raises(requests: dict) -> None:
    adapter, _ = requests["llama"]
    with pytest.raises(ValueError, match="empty chunk"):
        precompute_chunk(adapter, [])
    with pytest.raises(ValueError, match="at least one token"):
        PrecomputedChunk((), (torch.zeros(0, 2, 16),), (torch.zeros(0, 2, 16),), torch.zeros(1, 0))
    with pytest.raises(ValueError, match="at least one segment"):
        build_layout([])


def test_chunk_shape_mismatch_raises(requests: dict) -> None:
    adapter, segments = requests["llama"]
    good = segments[1].chunk
    three_layers = PrecomputedChunk(
        good.token_ids, good.keys[:3], good.values[:3], good.freq_scores[:3]
    )
    with pytest.raises(ValueError, match="does not match the model"):
        fused_prefill(adapter, [ChunkSegment(three_layers)], make_selector("a3", 0.2))
    wide = PrecomputedChunk(
        good.token_ids,
        tuple(torch.cat((k, k), dim=1) for k in good.keys),
        tuple(torch.cat((v, v), dim=1) for v in good.values),
        good.freq_scores,
    )
    with pytest.raises(ValueError, match="does not match the model"):
        fused_prefill(adapter, [ChunkSegment(wide), TextSegment((1,))], make_selector("freq", 0.2))
    with pytest.raises(ValueError, match="mismatch"):
        one_head = tuple(v[:, :1] for v in good.values)
        PrecomputedChunk(good.token_ids, good.keys, one_head, good.freq_scores)
    with pytest.raises(ValueError, match="keys must be"):
        PrecomputedChunk((1, 2), good.keys, good.values, good.freq_scores)
    with pytest.raises(ValueError, match="freq_scores"):
        PrecomputedChunk(good.token_ids, good.keys, good.values, good.freq_scores[:, :3])


@pytest.mark.parametrize("name", ["a3", "question_error", "question_attention"])
def test_a_prompt_ending_in_a_chunk_is_asked_by_its_last_token(requests: dict, name: str) -> None:
    """No text after the last chunk: the last token (always computed) is the question."""
    adapter, segments = requests["llama"]
    ending = [TextSegment((1, 2)), segments[1]]
    layout = build_layout(ending)
    assert layout.is_question.tolist() == [False] * (layout.num_tokens - 1) + [True]
    result = fused_prefill(adapter, ending, make_selector(name, 0.5))
    assert result.selected.numel() == round(0.5 * layout.num_chunk_tokens)


def test_unsupported_model_raises() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="unsupported model type 'gpt2'"):
        HFCausalLMAdapter(model)


def _fake_chunk(n: int) -> PrecomputedChunk:
    kv = (torch.zeros(n, 1, 4),)
    return PrecomputedChunk(tuple(range(n)), kv, kv, torch.zeros(1, n))


def test_question_error_is_the_first_order_change_of_question_outputs() -> None:
    """The score equals, term for term, sum over heads and question tokens of
    |a_i dv_i + a_i (scale q.dk_i) (v_i - o)| computed the slow way (GQA: 4 heads on 2 KV heads)."""
    from sglang_hicache_ext.fusion.selectors import CheckLayerState, SelectionContext

    generator = torch.Generator().manual_seed(11)
    segments = [
        TextSegment((1, 2, 3)),
        ChunkSegment(_random_chunk(9, generator)),
        TextSegment((4, 5, 6, 7), question=True),
    ]
    layout = build_layout(segments)
    n, heads, kv_heads, dim, scale = layout.num_tokens, 4, 2, 8, 0.35
    q = torch.randn(n, heads, dim, generator=generator)
    k = torch.randn(n, kv_heads, dim, generator=generator)
    v = torch.randn(n, kv_heads, dim, generator=generator)
    chunk = layout.chunk_positions
    reused_k = k[chunk] + 0.1 * torch.randn(len(chunk), kv_heads, dim, generator=generator)
    reused_v = v[chunk] + 0.1 * torch.randn(len(chunk), kv_heads, dim, generator=generator)
    state = CheckLayerState(1, q, k, v, reused_k, reused_v, scale)
    got = make_selector("question_error", 0.3).score(SelectionContext(layout, state))

    expected = torch.zeros(len(chunk))
    for h in range(heads):
        g = h // (heads // kv_heads)
        for p in torch.nonzero(layout.is_question).flatten().tolist():
            a = (k[: p + 1, g] @ q[p, h] * scale).softmax(-1)
            o = a @ v[: p + 1, g]
            for c, i in enumerate(chunk.tolist()):
                dk, dv = reused_k[c, g] - k[i, g], reused_v[c, g] - v[i, g]
                change = a[i] * dv + a[i] * scale * (q[p, h] @ dk) * (v[i, g] - o)
                expected[c] += change.norm()
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-6)


def _random_chunk(length: int, generator: torch.Generator) -> PrecomputedChunk:
    layers, kv_heads, dim = 2, 2, 8
    return PrecomputedChunk(
        token_ids=tuple(range(100, 100 + length)),
        keys=tuple(torch.randn(length, kv_heads, dim, generator=generator) for _ in range(layers)),
        values=tuple(
            torch.randn(length, kv_heads, dim, generator=generator) for _ in range(layers)
        ),
        freq_scores=torch.zeros(layers, length),
        alpha=0.5,
    )
