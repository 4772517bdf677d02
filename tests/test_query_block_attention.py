"""Scattered queries attended block by block over only the keys each block can see.

The fused prefill's queries sit at scattered, ascending positions; `position_causal_attention`
splits them into blocks and gives each block the keys up to its last query's position, with
what the blocks need (the GPU's mask, the CPU's split plan) built once per pair of position
tensors. On the CPU a block is the queries of one window of positions, and the keys before its
stretch of blocks go without a mask (merged by log-sum-exp), GQA heads folded into the rows. These tests pin that this changes nothing but the
work: the output equals a float64 dense softmax and the one-call masked SDPA it replaces, across
block edges, with MHA and GQA, on the split path and on the masked blocks it falls back to, and
a kept plan is never used for other positions; and that what the executor tells attention of
the layout (on a GPU, instead of reading positions back) is what the positions say.
"""

from __future__ import annotations

import gc
import itertools
import math

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang_hicache_ext.fusion import attention, executor, scattered_attention
from sglang_hicache_ext.fusion.attention import position_causal_attention
from sglang_hicache_ext.fusion.executor import FusionJob, fused_prefill_batch
from sglang_hicache_ext.fusion.selectors import make_selector
from tests.test_fusion_executor import _hf_prefix, _rag_request
from tests.test_position_attention import reference_attention


def _one_masked_call(q, k, v, q_pos, k_pos, scale):
    """What the scattered path computed before blocks: every query over every key."""
    mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
    out = scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.squeeze(0).transpose(0, 1)


def _scattered(num_keys: int, count: int, seed: int, late: bool = False) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    weights = torch.linspace(0.1, 1.0, num_keys) ** (4 if late else 0)
    picked = torch.multinomial(weights, count, replacement=False, generator=generator)
    return torch.sort(picked).values


@pytest.mark.parametrize("path", ["split", "masked"])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3)], ids=["mha", "gqa"])
@pytest.mark.parametrize("late", [False, True], ids=["spread", "late"])
def test_blocks_equal_reference_and_one_masked_call(
    path: str, heads: tuple[int, int], late: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`split`: the CPU's blocks split at their first query; `masked`: each block under one
    mask over all its keys (the CPU without torch's flash kernel with log-sum-exp)."""
    calls = []
    if path == "masked":
        monkeypatch.setattr(attention, "cpu_flash_with_lse", None)
    name = "split_block_attention" if path == "split" else "query_block_attention"
    blocked = getattr(scattered_attention, name)
    monkeypatch.setattr(attention, name, lambda *a: calls.append(1) or blocked(*a))
    torch.manual_seed(0)
    # Several stretches of blocks (the CPU's split path), the last one short, as is its last block.
    num_keys, count = 1500, 3 * scattered_attention.STRETCH_QUERIES + 17
    q_pos = _scattered(num_keys, count, seed=1, late=late)
    hq, hkv = heads
    q, k, v = (
        torch.randn(count, hq, 32),
        torch.randn(num_keys, hkv, 32),
        torch.randn(num_keys, hkv, 32),
    )
    k_pos = torch.arange(num_keys)
    scale = 1 / math.sqrt(32)
    out = position_causal_attention(q, k, v, q_pos, k_pos, scale)
    torch.testing.assert_close(
        out, reference_attention(q, k, v, q_pos, k_pos, scale), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        out, _one_masked_call(q, k, v, q_pos, k_pos, scale), atol=1e-6, rtol=1e-6
    )
    assert calls, f"ascending scattered queries take the {path} block path"


@pytest.mark.parametrize("density", [1.0, 0.5, 0.05])
def test_split_plan_cuts_windows_and_bounds_stretches(density: float) -> None:
    """Each CPU block holds the queries of one window of positions, in order and all of them;
    a stretch closes at its query count or before its masks would span more positions than
    allowed; each mask is the causal mask of the block's folded rows over the keys from its
    stretch's first query to its own last."""
    window, group = scattered_attention.CPU_WINDOW, 3
    num_keys = 6 * window + 31
    q_pos = _scattered(num_keys, max(1, int(density * num_keys)), 21)
    plan = scattered_attention._split_plan(q_pos, torch.float32, group)
    blocks = [block for stretch in plan for block in stretch]
    assert [b.start for b in blocks[1:]] == [b.end for b in blocks[:-1]]
    assert blocks[0].start == 0 and blocks[-1].end == len(q_pos)
    windows = [b.last // window for b in blocks]
    assert windows == sorted(set(windows)), "one block per window that holds queries"
    queries, span = scattered_attention.STRETCH_QUERIES, scattered_attention.STRETCH_SPAN
    for stretch, following in itertools.pairwise(plan):
        # A stretch closes only when full, or when the next block would span too far.
        assert (
            stretch[-1].end - stretch[0].start >= queries
            or following[0].last - stretch[0].first >= span
        )
    for stretch in plan:
        first = int(q_pos[stretch[0].start])
        if len(stretch) > 1:
            assert stretch[-2].end - stretch[0].start < queries
            assert stretch[-1].last - first < span
        for block in stretch:
            held = q_pos[block.start : block.end]
            assert len({int(p) // window for p in held}) == 1
            assert block.first == first and block.last == int(held[-1])
            keys = torch.arange(first, block.last + 1)
            visible = (keys.unsqueeze(0) <= held.unsqueeze(1)).repeat_interleave(group, dim=0)
            assert torch.equal(block.mask == 0, visible)


def test_split_blocks_in_bfloat16() -> None:
    """The split path merges its parts in float32 and returns the query's dtype."""
    torch.manual_seed(12)
    num_keys = 600
    q_pos = _scattered(num_keys, 2 * scattered_attention.QUERY_BLOCK + 9, 13)
    q, k, v = (
        torch.randn(len(q_pos), 9, 32),
        torch.randn(num_keys, 3, 32),
        torch.randn(num_keys, 3, 32),
    )
    k_pos = torch.arange(num_keys)
    out = position_causal_attention(*(t.bfloat16() for t in (q, k, v)), q_pos, k_pos, 0.2)
    assert out.dtype == torch.bfloat16
    expected = reference_attention(q, k, v, q_pos, k_pos, 0.2)
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("case", ["value_head_size", "query_past_the_keys"])
def test_split_path_leaves_what_its_kernel_cannot_take(case: str) -> None:
    """Values of another head size than the queries' (the CPU flash kernel refuses them), or a
    query past the last key (its own key absent): the masked blocks answer, exactly."""
    torch.manual_seed(14)
    num_keys, count = 700, 2 * scattered_attention.QUERY_BLOCK + 5
    q_pos = _scattered(num_keys, count, 15)
    value_dim = 16
    if case == "query_past_the_keys":
        q_pos[-1], num_keys = num_keys + 3, num_keys - 1
        value_dim = 32
    q, k, v = (
        torch.randn(count, 8, 32),
        torch.randn(num_keys, 2, 32),
        torch.randn(num_keys, 2, value_dim),
    )
    k_pos = torch.arange(num_keys)
    out = position_causal_attention(q, k, v, q_pos, k_pos, 0.2)
    assert out.shape == (count, 8, value_dim)
    torch.testing.assert_close(
        out, reference_attention(q, k, v, q_pos, k_pos, 0.2), atol=1e-5, rtol=1e-5
    )


def test_first_query_at_position_zero_and_block_edges() -> None:
    """Position 0 sees one key; a block ending at the last key sees all of them."""
    torch.manual_seed(2)
    num_keys = 2 * scattered_attention.QUERY_BLOCK + 40
    q_pos = torch.cat(
        (
            torch.tensor([0, 1]),
            _scattered(num_keys - 3, scattered_attention.QUERY_BLOCK, 3) + 2,
            torch.tensor([num_keys - 1]),
        )
    )
    q, k, v = (
        torch.randn(len(q_pos), 6, 16),
        torch.randn(num_keys, 2, 16),
        torch.randn(num_keys, 2, 16),
    )
    k_pos = torch.arange(num_keys)
    out = position_causal_attention(q, k, v, q_pos, k_pos, 0.25)
    torch.testing.assert_close(
        out, reference_attention(q, k, v, q_pos, k_pos, 0.25), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("late", [False, True], ids=["spread", "late"])
def test_gpu_blocks_from_host_positions_equal_one_masked_call(late: bool) -> None:
    """The GPU's blocks (few and large, key counts rounded up to 16, bounds read from a host
    copy of the positions), run here on the CPU: the same output as one masked call."""
    torch.manual_seed(10)
    num_keys = 3 * scattered_attention.GPU_MIN_BLOCK * scattered_attention.GPU_BLOCKS // 2 + 7
    count = 2 * scattered_attention.GPU_MIN_BLOCK * scattered_attention.GPU_BLOCKS // 2 + 5
    q_pos = _scattered(num_keys, count, 11, late=late)
    bounds = scattered_attention.block_bounds(q_pos, gpu=True, num_keys=num_keys)
    assert [b[0] for b in bounds[1:]] == [b[1] for b in bounds[:-1]] and bounds[-1][1] == count
    assert len(bounds) == scattered_attention.GPU_BLOCKS
    for _, end, visible in bounds:
        assert int(q_pos[end - 1]) < visible <= num_keys
        assert visible % 16 == 0 or visible == num_keys
    q, k, v = torch.randn(count, 8, 16), torch.randn(num_keys, 2, 16), torch.randn(num_keys, 2, 16)
    heads_first = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    out = scattered_attention.query_block_attention(
        *heads_first, q_pos, torch.arange(num_keys), 0.25, True, q_pos.clone(), gpu_blocks=True
    )
    expected = _one_masked_call(q, k, v, q_pos, torch.arange(num_keys), 0.25)
    torch.testing.assert_close(out.squeeze(0).transpose(0, 1), expected, atol=1e-6, rtol=1e-6)


def test_unsorted_queries_keep_the_one_call_path() -> None:
    """Blocks assume ascending positions; any other order is still answered exactly."""
    torch.manual_seed(4)
    num_keys = 400
    q_pos = _scattered(num_keys, 200, 5)[torch.randperm(200)]
    q, k, v = torch.randn(200, 4, 16), torch.randn(num_keys, 4, 16), torch.randn(num_keys, 4, 16)
    k_pos = torch.arange(num_keys)
    out = position_causal_attention(q, k, v, q_pos, k_pos, 0.25)
    torch.testing.assert_close(
        out, reference_attention(q, k, v, q_pos, k_pos, 0.25), atol=1e-5, rtol=1e-5
    )


def _kept_plans(q_pos: torch.Tensor) -> list[object]:
    kept = scattered_attention._kept._entries
    return [e.value for e in kept if scattered_attention._same(e.queries, q_pos)]


def test_kept_plan_follows_the_positions() -> None:
    """Layer after layer over the same position tensors the CPU's split plan is built once; new
    positions, or the same tensor changed in place, get their own plan."""
    torch.manual_seed(6)
    num_keys = 500
    q_pos, k_pos = _scattered(num_keys, 150, 7), torch.arange(num_keys)
    # Plans of earlier tests whose positions are still alive may stay; none of this test's may.
    earlier = list(scattered_attention._kept._entries)

    def check(q_pos: torch.Tensor) -> None:
        q, k, v = (
            torch.randn(150, 6, 16),
            torch.randn(num_keys, 2, 16),
            torch.randn(num_keys, 2, 16),
        )
        out = position_causal_attention(q, k, v, q_pos, k_pos, 0.25)
        torch.testing.assert_close(
            out, reference_attention(q, k, v, q_pos, k_pos, 0.25), atol=1e-5, rtol=1e-5
        )

    check(q_pos)
    [kept] = _kept_plans(q_pos)
    check(q_pos)  # the next layer: same positions, new activations
    assert [plan is kept for plan in _kept_plans(q_pos)] == [True]
    check(_scattered(num_keys, 150, 8))
    q_pos[:75] = _scattered(num_keys // 2, 75, 9)  # changed in place
    check(q_pos)
    [rebuilt] = _kept_plans(q_pos)
    assert rebuilt is not kept
    del q_pos
    gc.collect()
    entries = scattered_attention._kept._entries
    left = [e for e in entries if not any(e is old for old in earlier)]
    assert not left, "the plans go with their positions"


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("prefix_len", [0, 10, 60])
def test_layout_told_to_attention_matches_the_positions(
    models: dict, prefix_len: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU attention takes the executor's word for the layout (no read-back): `causal`
    only when the queries are the last rows in order, `host_positions` always the queries'
    positions. Every selector kind (check layer, scoring pass, before layer 0), with and without
    an exact prefix, alone and batched."""
    adapter = models["llama"]
    segments, ids = _rag_request(adapter)
    prefix = _hf_prefix(adapter, ids[:prefix_len]) if prefix_len else None
    told = []

    def checked(q, k, v, q_pos, k_pos, scale, backend, *, causal, host_positions, **layer):
        assert torch.equal(host_positions, q_pos.cpu()) and torch.equal(k_pos, torch.arange(len(k)))
        assert bool(torch.all(q_pos[1:] > q_pos[:-1]))
        last_rows = torch.equal(q_pos, torch.arange(len(k) - len(q), len(k)))
        assert causal == last_rows
        told.append(causal)
        assert layer == {"window": None, "logit_cap": 0.0}  # Llama: every layer full, uncapped
        return attention.attend(q, k, v, q_pos, k_pos, scale, backend)

    monkeypatch.setattr(executor, "attend", checked)
    jobs = [
        FusionJob(segments, make_selector(name, 0.3), exact_prefix=prefix)
        for name in ("full", "reuse", "a3", "cacheblend", "freq", "question_attention")
    ]
    for job in jobs:
        fused_prefill_batch(adapter, [job])
    fused_prefill_batch(adapter, jobs)
    # A prefix into the question leaves only question rows: the last ones, always causal.
    assert True in told and (False in told) == (prefix_len < 55)
