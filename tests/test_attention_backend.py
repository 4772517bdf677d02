"""`torch_position` against SGLang's own `torch_native` on the same pooled K/V."""

from __future__ import annotations

import pytest
import torch

from sglang_hicache_ext.sglang_ext.cpu.position_attention import BACKEND_NAME, _make_backend_class

pytest.importorskip("sglang.srt.layers.attention.torch_native_backend")
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402


def _backends():
    # The SDPA loops use no instance state but the kept rows of decode-time eviction (none
    # here), so the real classes run without a ModelRunner.
    from sglang_hicache_ext.sglang_ext.chunk_fusion.decode_keep import KeptRowsTable

    native = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)
    position_cls = _make_backend_class()
    position = position_cls.__new__(position_cls)
    position.kept_rows = KeptRowsTable()
    return native, position


def _pool(num_slots: int, heads: int, dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_slots, heads, dim, generator=gen), torch.randn(
        num_slots, heads, dim, generator=gen
    )


@pytest.mark.parametrize("prefix_lens", [(0, 0), (20, 5), (37, 0), (63, 12)], ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
def test_extend_matches_torch_native(prefix_lens: tuple[int, int], heads: tuple[int, int]) -> None:
    hq, hkv = heads
    k_cache, v_cache = _pool(256, hkv, 16, seed=sum(prefix_lens))
    extend_lens = torch.tensor([7, 19])
    prefix = torch.tensor(prefix_lens)
    seq_lens = prefix + extend_lens
    req_to_token = torch.zeros(4, 128, dtype=torch.long)
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(3))
    req_to_token[1, :128] = perm[:128]
    req_to_token[3, :128] = perm[128:]
    req_pool_indices = torch.tensor([3, 1])
    query = torch.randn(int(extend_lens.sum()), hq, 16)
    native, position = _backends()
    args = (k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, prefix, extend_lens)
    kwargs = dict(scaling=0.25, enable_gqa=hq != hkv, causal=True)
    expected = native._run_sdpa_forward_extend(query, torch.empty_like(query), *args, **kwargs)
    got = position._run_sdpa_forward_extend(query, torch.empty_like(query), *args, **kwargs)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_decode_matches_torch_native() -> None:
    k_cache, v_cache = _pool(64, 2, 16, seed=5)
    req_to_token = torch.arange(64).reshape(2, 32)
    seq_lens = torch.tensor([9, 32])
    req_pool_indices = torch.tensor([1, 0])
    query = torch.randn(2, 6, 16)
    native, position = _backends()
    args = (k_cache, v_cache, req_to_token, req_pool_indices, seq_lens)
    expected = native._run_sdpa_forward_decode(
        query, torch.empty_like(query), *args, scaling=0.25, enable_gqa=True
    )
    got = position._run_sdpa_forward_decode(
        query, torch.empty_like(query), *args, scaling=0.25, enable_gqa=True
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_registered_as_attention_backend() -> None:
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    from sglang_hicache_ext.sglang_ext.cpu import position_attention as attention_backend

    attention_backend.register()
    assert BACKEND_NAME in ATTENTION_BACKENDS
    assert BACKEND_NAME in ATTENTION_BACKEND_CHOICES
