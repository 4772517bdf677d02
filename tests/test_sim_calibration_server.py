"""The fidelity machinery against a real CPU server, on a small slice where hits are exact.

The full calibration and fidelity run is a benchmark (`hicache-ext-calibrate`); here a handful
of multi-turn requests check that replay, hit accounting and the simulator agree.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_hicache_ext.sglang_ext.tools.calibration_fidelity import DEPLOYMENTS, replay_on_server
from sglang_hicache_ext.sglang_ext.tools.calibration_server import (
    calibration_server,
    server_config,
)
from sglang_hicache_ext.tuning.sim.profile import Profile
from sglang_hicache_ext.tuning.sim.scaled_slice import SliceSpec, scale_slice
from sglang_hicache_ext.tuning.sim.simulator import simulate
from sglang_hicache_ext.tuning.trace import SimRequest

pytestmark = pytest.mark.server


def _conversations() -> list[SimRequest]:
    """Three conversations of three turns behind one shared block."""
    requests = []
    for turn in range(3):
        for conv in range(3):
            blocks = ("sys", *(f"c{conv}-t{t}-{i}" for t in range(turn + 1) for i in range(4)))
            arrival = turn * 6.0 + conv * 2.0
            requests.append(SimRequest(arrival, len(blocks) * 512, 64, blocks))
    return sorted(requests, key=lambda r: r.arrival_s)


def test_replay_hit_ratio_matches_the_simulator(tiny_smollm2_path: Path, tmp_path: Path) -> None:
    # Hits are the prefix tree's, not the weights': SmolLM2's tokenizer over random weights.
    # Requests of 80-208 tokens take well under a second here; 2 s between arrivals and 6 s between a
    # conversation's turns leave each turn cached before the next even on a busy machine.
    scaled = scale_slice(_conversations(), SliceSpec(count=9, time_scale=1.0))
    profile = Profile(kv_bytes_per_token=46080, block_tokens=16, prefix_cache_tokens=8192)
    gpu_only = DEPLOYMENTS[0]
    sim = simulate([r.as_sim_request() for r in scaled], gpu_only.sim_config(profile), profile)
    config = server_config(tiny_smollm2_path, hierarchical=False)
    with calibration_server(config, tmp_path / "server.log") as url:
        run = replay_on_server(url, scaled)
    # Later turns find their earlier turns (and all find the shared block): 44 of 81 blocks.
    assert sim.hit_ratio.total == pytest.approx(44 / 81)
    assert run.hit_ratio == pytest.approx(sim.hit_ratio.total, abs=0.05)
    assert run.hit_by_tier["device"] == pytest.approx(run.hit_ratio)
    assert run.mean_ttft_s > 0 and run.throughput_tok_s > 0
