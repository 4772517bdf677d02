"""CPU compatibility pieces: the KV row copy, the unpinned host pool, a prefill's first token."""

from __future__ import annotations

from collections.abc import Callable

import torch

from sglang_hicache_ext.sglang_ext.cpu.compat import _unpinned_host_pool, transfer_kv_direct_torch


def test_transfer_copies_rows_per_layer() -> None:
    src = [torch.randn(32, 2, 4), torch.randn(32, 2, 4)]
    dst = [torch.zeros(16, 2, 4), torch.zeros(16, 2, 4)]
    src_idx = torch.tensor([4, 5, 6, 7, 20, 21, 22, 23])
    dst_idx = torch.tensor([8, 9, 10, 11, 0, 1, 2, 3])
    transfer_kv_direct_torch(src, dst, src_idx, dst_idx, page_size=4)
    for s, d in zip(src, dst, strict=True):
        torch.testing.assert_close(d[dst_idx], s[src_idx])
        assert torch.count_nonzero(d[12:16]) == 0


def test_transfer_rejects_mismatched_indices() -> None:
    import pytest

    with pytest.raises(ValueError, match="source rows"):
        transfer_kv_direct_torch(
            [torch.zeros(4, 1)], [torch.zeros(4, 1)], torch.tensor([0, 1]), torch.tensor([0]), 1
        )


def test_host_pool_pinning_turned_off_unless_given() -> None:
    args = ("self", "info", 2.0, 0, 16, "layer_first")
    assert _unpinned_host_pool(*args, allocator_type="default") == (
        args,
        {"allocator_type": "default", "pin_memory": False},
    )
    # An explicit positional or keyword choice is the caller's and is kept.
    assert _unpinned_host_pool(*args, True) is None
    assert _unpinned_host_pool(*args, pin_memory=False) is None


def test_a_prefills_first_token_is_processed_before_the_next_forward_on_cpu() -> None:
    """The overlap loop asks whether to process the last batch before running the next one:
    on CPU, yes after a prefill (its first token would otherwise wait a decode step), as
    SGLang decides otherwise (decode after decode keeps the overlap)."""
    from collections import deque
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_hicache_ext.sglang_ext.cpu.compat import _first_token_before_next_forward

    def batch(mode: ForwardMode) -> SimpleNamespace:
        return SimpleNamespace(forward_mode=mode)

    def sglang_says(answer: bool) -> Callable[..., bool]:
        return lambda *_: answer

    cpu = SimpleNamespace(device="cpu", result_queue=deque([object()]))
    prefill, decode = batch(ForwardMode.EXTEND), batch(ForwardMode.DECODE)
    assert _first_token_before_next_forward(sglang_says(False), cpu, decode, prefill)
    assert _first_token_before_next_forward(sglang_says(False), cpu, None, prefill)
    assert not _first_token_before_next_forward(sglang_says(False), cpu, decode, decode)
    assert not _first_token_before_next_forward(sglang_says(False), cpu, prefill, None)
    assert _first_token_before_next_forward(sglang_says(True), cpu, decode, decode)
    nothing_queued = SimpleNamespace(device="cpu", result_queue=deque())
    assert not _first_token_before_next_forward(sglang_says(False), nothing_queued, decode, prefill)
    gpu = SimpleNamespace(device="cuda", result_queue=deque([object()]))
    assert not _first_token_before_next_forward(sglang_says(False), gpu, decode, prefill)
