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
    """The overlap loop asks whether to process the last batch's result before running the
    next batch: on CPU, yes when that result is a prefill's (its first token would otherwise
    wait a decode step), as SGLang decides otherwise (decode after decode keeps the overlap).
    The loop passes the running batch as `last_batch`, which the prefill joined and which is in
    decode mode by then; the queued result holds the batch as it ran."""
    from collections import deque
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_hicache_ext.sglang_ext.cpu.compat import _first_token_before_next_forward

    def batch(mode: ForwardMode) -> SimpleNamespace:
        return SimpleNamespace(forward_mode=mode, is_extend_in_batch=mode.is_extend())

    def sglang_says(answer: bool) -> Callable[..., bool]:
        return lambda *_: answer

    def scheduler(device: str, *queued: ForwardMode, synced: bool = False) -> SimpleNamespace:
        return SimpleNamespace(
            device=device,
            result_queue=deque((batch(m), None) for m in queued),
            require_mlp_sync=synced,
        )

    running = batch(ForwardMode.DECODE)  # the prefill's batch, turned to decode mode
    after_prefill = scheduler("cpu", ForwardMode.EXTEND)
    assert _first_token_before_next_forward(sglang_says(False), after_prefill, running, running)
    assert _first_token_before_next_forward(sglang_says(False), after_prefill, None, running)
    after_mixed = scheduler("cpu", ForwardMode.MIXED)  # chunked prefill beside decodes
    assert _first_token_before_next_forward(sglang_says(False), after_mixed, running, running)
    after_decode = scheduler("cpu", ForwardMode.DECODE)
    assert not _first_token_before_next_forward(sglang_says(False), after_decode, running, running)
    assert _first_token_before_next_forward(sglang_says(True), after_decode, running, running)
    nothing_queued = scheduler("cpu")
    assert not _first_token_before_next_forward(sglang_says(False), nothing_queued, running, None)
    gpu = scheduler("cuda", ForwardMode.EXTEND)
    assert not _first_token_before_next_forward(sglang_says(False), gpu, running, running)
    # Data-parallel attention: the flag every rank shares (this rank may have run an idle batch).
    idle_here = scheduler("cpu", ForwardMode.IDLE, synced=True)
    idle_here.result_queue[0][0].is_extend_in_batch = True
    assert _first_token_before_next_forward(sglang_says(False), idle_here, running, running)
