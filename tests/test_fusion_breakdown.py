"""The fused-prefill breakdown's arithmetic: exclusive stage times and the work counts."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from benchmarks.prefill_flops import DecoderShape, fused_work, normal_work
from benchmarks.stage_timer import StageTimer

SMOLLM2 = DecoderShape(
    num_layers=30,
    hidden=576,
    intermediate=1536,
    num_q_heads=9,
    num_kv_heads=3,
    head_dim=64,
    vocab=49152,
)


def test_nested_calls_are_charged_to_their_own_stage_once() -> None:
    owner = SimpleNamespace()
    owner.inner = lambda: time.sleep(0.02)
    owner.rope = lambda: time.sleep(0.01)

    def outer() -> None:
        time.sleep(0.03)
        owner.inner()
        owner.rope()  # inherits: inside a load it is load

    owner.outer = outer
    timer = StageTimer()
    timer.wrap(owner, "outer", "load")
    timer.wrap(owner, "inner", "attention")
    timer.wrap(owner, "rope", "recompute", inherits=True)
    began = time.perf_counter()
    owner.outer()
    owner.rope()  # alone: its own stage
    wall = time.perf_counter() - began
    assert abs(sum(timer.seconds.values()) - wall) < 0.005
    assert 0.02 <= timer.seconds["attention"] < 0.03
    assert 0.04 <= timer.seconds["load"] < 0.05
    assert 0.01 <= timer.seconds["recompute"] < 0.02
    timer.restore()
    assert not hasattr(owner.outer, "__wrapped__") and "rope" in vars(owner)


def test_fused_work_with_every_token_computed_is_the_normal_prefill() -> None:
    n = 300
    everything = torch.arange(n)
    for check_layer in (None, 1):
        assert fused_work(SMOLLM2, n, everything, check_layer) == normal_work(SMOLLM2, n)


def test_fused_work_counts_the_check_layer_and_the_read_rows() -> None:
    n, active = 1000, torch.tensor([10, 500, 998, 999])
    per_token = SMOLLM2.qkv_macs + SMOLLM2.rest_macs
    sparse = fused_work(SMOLLM2, n, active, None)
    assert sparse.linear == 30 * 4 * per_token
    assert sparse.attention == 30 * (11 + 501 + 999 + 1000) * SMOLLM2.pair_macs
    checked = fused_work(SMOLLM2, n, active, 1)
    # Layer 0 computes everything; the check layer projects q/k/v of every token.
    assert checked.linear == sparse.linear + (n - 4) * (per_token + SMOLLM2.qkv_macs)
    read_last = fused_work(SMOLLM2, n, active, 1, last_layer_outputs=1)
    assert checked.linear - read_last.linear == 3 * SMOLLM2.rest_macs
    assert checked.attention - read_last.attention == (11 + 501 + 999) * SMOLLM2.pair_macs
