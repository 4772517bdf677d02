"""Decode-time eviction after a fused prefill (fusion/decode_eviction.py) on the tiny models."""

from __future__ import annotations

import pytest
import torch

from sglang_hicache_ext.evaluation.fused_answers import run_method
from sglang_hicache_ext.fusion.adapters.hf import HFCausalLMAdapter
from sglang_hicache_ext.fusion.decode_eviction import (
    DEFAULT_WINDOW,
    capacity_tokens,
    evict,
    keep_whole_mask,
    kept_positions,
    window_scores,
)
from sglang_hicache_ext.fusion.decoding import decode_step
from sglang_hicache_ext.fusion.executor import fused_prefill
from sglang_hicache_ext.fusion.selectors import make_selector
from tests.test_fusion_executor import _rag_request

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = ["llama", "qwen2"]


def test_window_scores_are_the_window_attention_summed_over_queries_and_groups() -> None:
    torch.manual_seed(0)
    keys = torch.randn(12, 2, 8)
    queries = torch.randn(3, 4, 8)  # two query heads per KV head
    positions = torch.tensor([9, 10, 11])
    got = window_scores(queries, positions, keys, 0.35)
    # By hand: softmax per (query head, window query) over the keys it sees, summed.
    expected = torch.zeros(2, 12)
    for w, position in enumerate(positions.tolist()):
        for head in range(4):
            logits = keys[: position + 1, head // 2] @ queries[w, head] * 0.35
            expected[head // 2, : position + 1] += logits.softmax(-1)
    pooled = torch.nn.functional.avg_pool1d(
        expected.unsqueeze(1), 5, stride=1, padding=2, count_include_pad=False
    ).squeeze(1)
    assert torch.allclose(got, pooled, atol=1e-5)
    # Every window query spreads one unit of attention per query head.
    assert float(expected.sum()) == pytest.approx(3 * 4, rel=1e-5)


@pytest.mark.parametrize("capacity", [1, 6, 9, 20])
def test_kept_positions_keep_the_whole_text_and_the_top_scores(capacity: int) -> None:
    scores = torch.rand(3, 2, 20, generator=torch.Generator().manual_seed(capacity))
    whole = torch.zeros(20, dtype=torch.bool)
    whole[:3] = True
    whole[-3:] = True
    kept = kept_positions(scores, whole, capacity)
    expected_size = min(max(capacity, 6), 20)
    assert kept.shape == (3, 2, expected_size)
    for layer in range(3):
        for head in range(2):
            row = kept[layer, head].tolist()
            assert row == sorted(row) and len(set(row)) == len(row)
            assert {0, 1, 2, 17, 18, 19} <= set(row)
            others = [p for p in row if not whole[p]]
            rest = [p for p in range(20) if not whole[p] and p not in row]
            if others and rest:  # every kept chunk token outscores every evicted one
                assert min(scores[layer, head, others]) >= max(scores[layer, head, rest])


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_capacity_outside_zero_one_is_refused(fraction: float) -> None:
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        capacity_tokens(fraction, 100)


@pytest.mark.parametrize("family", FAMILIES)
def test_full_capacity_decodes_exactly_as_without_eviction(models: dict, family: str) -> None:
    adapter: HFCausalLMAdapter = models[family]
    segments, _ = _rag_request(adapter)
    selector = make_selector("a3", 0.3)
    plain = fused_prefill(adapter, segments, selector, return_kv=True)
    scored = fused_prefill(adapter, segments, selector, return_kv=True, decode_window=8)
    assert scored.window_scores is not None and plain.window_scores is None
    assert scored.window_scores.shape == (
        adapter.shape.num_layers,
        adapter.shape.num_kv_heads,
        scored.num_tokens,
    )
    # Scoring never changes the prefill.
    assert torch.equal(plain.logits, scored.logits)
    every = kept_positions(scored.window_scores, keep_whole_mask(segments), scored.num_tokens)
    assert plain.kv is not None and scored.kv is not None
    evicted = evict(scored.kv, every)
    token = int(plain.logits.argmax())
    want, _ = decode_step(adapter, plain.kv, token)
    got, after = decode_step(adapter, evicted, token)
    assert torch.allclose(want, got, atol=1e-4)
    assert after.position == scored.num_tokens + 1


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fraction", [0.25, 0.6])
def test_eviction_keeps_capacity_rows_per_head_and_text_whole(
    models: dict, family: str, fraction: float
) -> None:
    adapter: HFCausalLMAdapter = models[family]
    segments, ids = _rag_request(adapter)
    prefill = fused_prefill(
        adapter, segments, make_selector("a3", 0.2), return_kv=True, decode_window=DEFAULT_WINDOW
    )
    assert prefill.window_scores is not None and prefill.kv is not None
    whole = keep_whole_mask(segments)
    capacity = capacity_tokens(fraction, len(ids))
    kept = kept_positions(prefill.window_scores, whole, capacity)
    evicted = evict(prefill.kv, kept)
    size = max(capacity, int(whole.sum()))
    assert evicted.num_tokens == size and evicted.position == len(ids)
    # Row i of head h is the K of that head's i-th kept token.
    layer, head = 1, adapter.shape.num_kv_heads - 1
    assert torch.equal(
        evicted.keys[layer][:, head], prefill.kv.keys[layer][kept[layer, head], head]
    )
    flat = kept.flatten(0, 1)
    if capacity <= int(whole.sum()):  # the text alone fills the capacity: no chunk token kept
        assert all(torch.equal(row, torch.nonzero(whole).flatten()) for row in flat)
    else:  # heads choose independently: not every (layer, head) keeps the same tokens
        assert any(not torch.equal(flat[0], row) for row in flat[1:])


@pytest.mark.parametrize("family", FAMILIES)
def test_run_method_with_capacity_one_equals_without(models: dict, family: str) -> None:
    adapter: HFCausalLMAdapter = models[family]
    segments, _ = _rag_request(adapter)
    selector = make_selector("a3", 0.3)
    plain = run_method(adapter, segments, selector, set(), 6)
    full_capacity = run_method(adapter, segments, selector, set(), 6, decode_capacity=1.0)
    assert plain.answer == full_capacity.answer
    evicted = run_method(adapter, segments, selector, set(), 6, decode_capacity=0.25)
    assert len(evicted.answer) == 6 and evicted.first_logits.equal(plain.first_logits)


@pytest.mark.parametrize("decoded", [1, 5])
def test_kept_rows_over_the_kv_pool_equal_attention_over_each_heads_rows(decoded: int) -> None:
    """The SGLang adapter's decode over a request's kept pool rows: at full capacity what the
    backend computes without eviction; below it, each head over exactly its kept rows (read
    from the pool before the rows were moved into the request's first slots)."""
    from sglang_hicache_ext.fusion.attention import gather_attend
    from sglang_hicache_ext.sglang_ext.chunk_fusion.decode_keep import KeptRows

    generator = torch.Generator().manual_seed(decoded)
    pool, heads, dim, prompt = 64, 2, 8, 20
    k_cache = torch.randn(pool, heads, dim, generator=generator)
    v_cache = torch.randn(pool, heads, dim, generator=generator)
    row = torch.randperm(pool, generator=generator)[: prompt + decoded].to(torch.int32)
    query = torch.randn(1, 4, dim, generator=generator)
    seq_len = prompt + decoded
    every = torch.arange(prompt).expand(1, heads, prompt)
    plain = gather_attend(query, k_cache, v_cache, row[:seq_len], torch.tensor([seq_len - 1]), 0.3)
    whole = KeptRows(0, prompt, 0, every).attend(0, query, k_cache, v_cache, row, seq_len, 0.3)
    assert torch.allclose(whole, plain, atol=1e-6)
    kept = torch.stack([torch.tensor([0, 1, 7, 19]), torch.tensor([0, 1, 2, 11])]).unsqueeze(0)
    original_k, original_v = k_cache.clone(), v_cache.clone()
    prefix_slots = row[:2].long()
    rows = KeptRows(0, prompt, 2, kept)
    got = rows.attend(0, query, k_cache, v_cache, row, seq_len, 0.3)
    for head in range(heads):
        slots = torch.cat((row[kept[0, head]], row[prompt:seq_len])).long()
        for q_head in (2 * head, 2 * head + 1):  # the two query heads of KV head `head`
            scores = (original_k[slots, head] @ query[0, q_head]) * 0.3
            expected = scores.softmax(-1) @ original_v[slots, head]
            assert torch.allclose(got[0, q_head], expected, atol=1e-6)
    # Moved in place: the next step reads the same rows; the shared prefix slots were not written.
    again = rows.attend(0, query, k_cache, v_cache, row, seq_len, 0.3)
    assert torch.equal(again, got) and torch.equal(k_cache[prefix_slots], original_k[prefix_slots])
    with pytest.raises(ValueError, match="keep the shared positions"):
        KeptRows(0, prompt, 3, kept).attend(0, query, k_cache, v_cache, row, seq_len, 0.3)


def test_a_kept_set_never_outlives_its_pool_rows_generation() -> None:
    from sglang_hicache_ext.sglang_ext.chunk_fusion.decode_keep import KeptRows, KeptRowsTable

    table = KeptRowsTable()
    generations = torch.tensor([0, 4, 7, 2])
    positions = torch.zeros(1, 1, 1, dtype=torch.long)
    table.put(1, KeptRows(4, 10, 0, positions), generations)
    table.put(2, KeptRows(7, 10, 0, positions), generations)
    assert table.get(1, 4) is not None and len(table) == 2
    assert table.get(1, 5) is None and len(table) == 1  # row 1 went to another request
    generations[2] = 8  # row 2 reallocated: dropped at the next put
    table.put(3, KeptRows(2, 10, 0, positions), generations)
    assert len(table) == 1 and table.get(3, 2) is not None


def test_a_mixed_batch_decodes_evicted_requests_over_their_kept_rows_only() -> None:
    """--enable-mixed-chunk decodes through extend: a request decoding past its prompt reads its
    kept rows there too, a request prefilling beside it reads all of its rows."""
    from types import SimpleNamespace

    from sglang_hicache_ext.fusion.attention import gather_attend
    from sglang_hicache_ext.sglang_ext.chunk_fusion.decode_keep import KeptRows, KeptRowsTable
    from sglang_hicache_ext.sglang_ext.cpu.position_attention import _attend_new_queries

    generator = torch.Generator().manual_seed(3)
    k_cache, v_cache = (torch.randn(80, 2, 8, generator=generator) for _ in range(2))
    req_to_token = torch.zeros(4, 40, dtype=torch.int32)
    req_to_token[1, :25] = torch.arange(1, 26)
    req_to_token[2, :30] = torch.arange(30, 60)
    kept_rows = KeptRowsTable()
    backend = SimpleNamespace(
        req_to_token_pool=SimpleNamespace(req_generation=torch.tensor([0, 5, 9, 0])),
        _layer=0,
        kept_rows=kept_rows,
    )
    kept = KeptRows(5, 20, 0, torch.tensor([[[0, 2, 5, 9], [1, 2, 3, 19]]]))
    kept_rows.put(1, kept, backend.req_to_token_pool.req_generation)
    expected_kept = KeptRows(5, 20, 0, kept.positions.clone())
    query = torch.randn(4, 4, 8, generator=generator)  # 1 decode query + 3 prefill queries
    call = {
        "query": query,
        "output": torch.empty_like(query),
        "req_to_token": req_to_token,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "scaling": 0.3,
        "req_pool_indices": torch.tensor([1, 2]),
        "seq_lens": torch.tensor([25, 30]),
    }
    prefill = gather_attend(
        query[1:], k_cache, v_cache, req_to_token[2, :30], torch.arange(27, 30), 0.3
    )
    out = _attend_new_queries(call, backend, [24, 27], [1, 3])
    assert torch.allclose(out[1:], prefill, atol=1e-6)
    k_copy, v_copy = k_cache.clone(), v_cache.clone()  # already compacted by the call above
    expected_kept.compacted.add(0)
    decode = expected_kept.attend(0, query[:1], k_copy, v_copy, req_to_token[1], 25, 0.3)
    assert torch.allclose(out[:1], decode, atol=1e-6)
    with pytest.raises(RuntimeError, match="one token per step"):
        _attend_new_queries({**call, "output": torch.empty_like(query)}, backend, [23, 28], [2, 2])
    assert kept_rows.decode_steps == 1
    # The row reallocated (generation 7): its stale kept set is never applied.
    kept_rows.put(1, KeptRows(-1, 0, 0, kept.positions), torch.tensor([0, 7, 0, 0]))
    assert kept_rows.get(1, 7) is None and len(kept_rows) == 0
