"""The fused-prefill breakdown's arithmetic: exclusive stage times and the work counts."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig

from benchmarks.prefill_flops import DecoderShape, fused_work, normal_work
from benchmarks.stage_timer import StageTimer


@pytest.fixture(scope="module")
def smollm2_shape(smollm2_path: Path) -> DecoderShape:
    return DecoderShape.from_config(AutoConfig.from_pretrained(smollm2_path))


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
    # Every second counted once: the stages add up to the wall time of the outer calls.
    assert abs(sum(timer.seconds.values()) - wall) < 0.005
    assert dict(timer.calls) == {"attention": 1, "load": 1, "recompute": 1}
    assert timer.seconds["attention"] >= 0.02
    assert timer.seconds["load"] >= 0.04  # its own 0.03 s and the inherited rope
    assert timer.seconds["recompute"] >= 0.01
    timer.restore()
    assert not hasattr(owner.outer, "__wrapped__") and "rope" in vars(owner)


def test_fused_work_with_every_token_computed_is_the_normal_prefill(
    smollm2_shape: DecoderShape,
) -> None:
    n = 300
    everything = torch.arange(n)
    for check_layer in (None, 1):
        assert fused_work(smollm2_shape, n, everything, check_layer) == normal_work(
            smollm2_shape, n
        )


def test_fused_work_counts_the_check_layer_and_the_read_rows(smollm2_shape: DecoderShape) -> None:
    assert smollm2_shape.num_layers == 30
    n, active = 1000, torch.tensor([10, 500, 998, 999])
    per_token = smollm2_shape.qkv_macs + smollm2_shape.rest_macs
    sparse = fused_work(smollm2_shape, n, active, None)
    assert sparse.linear == 30 * 4 * per_token
    assert sparse.attention == 30 * (11 + 501 + 999 + 1000) * smollm2_shape.pair_macs
    checked = fused_work(smollm2_shape, n, active, 1)
    # Layer 0 computes everything; the check layer projects q/k/v of every token.
    assert checked.linear == sparse.linear + (n - 4) * (per_token + smollm2_shape.qkv_macs)
    read_last = fused_work(smollm2_shape, n, active, 1, last_layer_outputs=1)
    assert checked.linear - read_last.linear == 3 * smollm2_shape.rest_macs
    assert checked.attention - read_last.attention == (11 + 501 + 999) * smollm2_shape.pair_macs
