"""Scaled trace slices: lengths and times scaled, shared block ids give shared token prefixes."""

from __future__ import annotations

import pytest

from sglang_hicache_ext.tuning.sim.scaled_slice import SliceSpec, scale_slice
from sglang_hicache_ext.tuning.trace import SimRequest

TRACE = [
    SimRequest(10.0, 1024, 320, ("0", "1")),
    SimRequest(11.0, 1600, 64, ("0", "1", "2", "3")),
    SimRequest(12.5, 2000, 3, ("0", "9", "8", "7")),
]


def test_lengths_times_and_shared_prefixes() -> None:
    scaled = scale_slice(TRACE, SliceSpec(count=3, length_scale=32, time_scale=4, block_tokens=16))
    assert [r.arrival_s for r in scaled] == [0.0, 4.0, 10.0]
    assert [len(r.input_ids) for r in scaled] == [32, 50, 62]
    assert [r.output_tokens for r in scaled] == [10, 2, 1]  # at least one output token
    assert [r.blocks for r in scaled] == [("0", "1"), ("0", "1", "2", "3"), ("0", "9", "8", "7")]
    first, second, third = (r.input_ids for r in scaled)
    assert second[:32] == first  # same blocks, same tokens
    assert third[:16] == first[:16] and third[16:32] != first[16:32]
    assert all(1000 <= t < 40_000 for t in second)
    sim = scaled[1].as_sim_request()
    assert (sim.input_tokens, sim.output_tokens, sim.blocks) == (50, 2, scaled[1].blocks)


def test_slice_window_and_length_cap() -> None:
    scaled = scale_slice(TRACE, SliceSpec(first=1, count=5, max_input_tokens=40, block_tokens=16))
    assert len(scaled) == 2 and scaled[0].arrival_s == 0.0
    assert [len(r.input_ids) for r in scaled] == [40, 40]
    assert [len(r.blocks) for r in scaled] == [3, 3]
    with pytest.raises(ValueError, match="no request"):
        scale_slice(TRACE, SliceSpec(first=3))
    with pytest.raises(ValueError, match="scales"):
        SliceSpec(time_scale=0)
