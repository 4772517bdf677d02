"""The position-masked attention op against a dense reference softmax."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_hicache_ext.fusion.attention import gather_attend, position_causal_attention


def reference_attention(q, k, v, q_pos, k_pos, scale):
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).double()
    v = v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    scores = scores.masked_fill(~(k_pos[None, None, :] <= q_pos[None, :, None]), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


CASES = {
    # name: (query positions, number of keys)
    "full_causal": (torch.arange(0, 48), 48),
    "prefix_extend": (torch.arange(32, 48), 48),  # a long prefix: attended apart, merged
    "short_prefix_extend": (torch.arange(8, 48), 48),  # a short one: placeholder queries
    "decode": (torch.tensor([47]), 48),
    "scattered": (torch.tensor([3, 9, 10, 30, 47]), 48),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
def test_matches_reference(case: str, heads: tuple[int, int]) -> None:
    torch.manual_seed(0)
    q_pos, num_keys = CASES[case]
    hq, hkv = heads
    q = torch.randn(len(q_pos), hq, 16)
    k = torch.randn(num_keys, hkv, 16)
    v = torch.randn(num_keys, hkv, 16)
    k_pos = torch.arange(num_keys)
    scale = 1 / math.sqrt(16)
    out = position_causal_attention(q, k, v, q_pos, k_pos, scale)
    torch.testing.assert_close(
        out, reference_attention(q, k, v, q_pos, k_pos, scale), atol=1e-5, rtol=1e-5
    )


def test_extend_rows_equal_full_prefill_rows() -> None:
    """Attending only the new queries gives exactly the rows a full causal pass would."""
    torch.manual_seed(1)
    q, k, v = torch.randn(64, 4, 8), torch.randn(64, 2, 8), torch.randn(64, 2, 8)
    pos = torch.arange(64)
    full = position_causal_attention(q, k, v, pos, pos)
    tail = position_causal_attention(q[40:], k, v, pos[40:], pos)
    torch.testing.assert_close(tail, full[40:], atol=1e-6, rtol=1e-6)


def test_gather_attend_reads_slots_in_sequence_order() -> None:
    torch.manual_seed(2)
    pool_k, pool_v = torch.randn(100, 2, 8), torch.randn(100, 2, 8)
    slots = torch.tensor([57, 3, 91, 12, 40])
    q = torch.randn(2, 2, 8)
    q_pos = torch.tensor([3, 4])
    out = gather_attend(q, pool_k, pool_v, slots, q_pos)
    expected = position_causal_attention(q, pool_k[slots], pool_v[slots], q_pos, torch.arange(5))
    torch.testing.assert_close(out, expected)


def test_empty_query() -> None:
    out = position_causal_attention(
        torch.empty(0, 4, 8),
        torch.randn(5, 4, 8),
        torch.randn(5, 4, 8),
        torch.empty(0, dtype=torch.long),
        torch.arange(5),
    )
    assert out.shape == (0, 4, 8)
