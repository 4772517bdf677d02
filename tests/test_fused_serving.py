"""The fused-serving TTFT model of the simulator (`tuning/sim/fused_serving.py`) on the H200
measurements it is built from: the normal prefill where nothing is reused or the reuse is below
the break-even, the fused time plus each tier's transfer where it is, and the FIFO queue."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from sglang_hicache_ext.tuning.sim.fused_serving import FusedPrefillTimes, Load, fifo_ttfts

GPU_REPORT = Path(__file__).parents[1] / "benchmarks" / "results" / "fusion_gpu_h200.json"


@pytest.fixture(scope="module")
def h200() -> FusedPrefillTimes:
    report = json.loads(GPU_REPORT.read_text())
    return FusedPrefillTimes.from_gpu_benchmark(
        report, "llama3_8b", "question_attention@0.15", "flashinfer", 3e9, min_share=0.3
    )


def test_the_measured_points_and_rate_are_read_from_the_report(h200: FusedPrefillTimes) -> None:
    report = json.loads(GPU_REPORT.read_text())
    (llama,) = [m for m in report["models"] if m["name"] == "llama3_8b"]
    row = next(r for r in llama["results"] if r["tokens"] == 16384)
    assert h200.lengths == (4096, 16384, 32768)
    assert h200.full(16384) == row["full"]["flashinfer"]["ttft_s"]
    assert h200.fused(16384) == row["fused"]["question_attention@0.15"]["flashinfer"]["ttft_s"]
    measured = row["host_loads_by_selector"]["question_attention"]["h2d_gb_per_s"]
    assert h200.h2d_bytes_per_s == pytest.approx(measured * 1e9)
    # Below the shortest length the time scales with the tokens; between, linear.
    assert h200.full(2048) == pytest.approx(h200.full(4096) / 2)
    middle = (h200.full(4096) + h200.full(16384)) / 2
    assert h200.full(10240) == pytest.approx(middle)


def test_ttft_is_the_normal_prefill_without_reuse_or_below_the_break_even(
    h200: FusedPrefillTimes,
) -> None:
    assert h200.ttft(16384, []) == h200.full(16384)
    few = [Load(4000, 4000 * 131072, "host")]  # 0.24 of the prompt: below 0.3
    assert h200.ttft(16384, few) == h200.full(16384)


def test_ttft_adds_each_tier_transfer_to_the_fused_compute(h200: FusedPrefillTimes) -> None:
    tokens, kv = 16384, 131072
    host = [
        Load(tokens // 2, tokens // 2 * kv, "host"),
        Load(tokens // 2, tokens // 2 * kv, "host"),
    ]
    compute = h200.fused(tokens)
    assert h200.ttft(tokens, host) == pytest.approx(compute + tokens * kv / h200.h2d_bytes_per_s)
    int8 = [Load(tokens, tokens * kv // 2, "host")]
    assert h200.ttft(tokens, int8) < h200.ttft(tokens, host)
    disk = [Load(tokens, tokens * kv, "disk")]
    slower = tokens * kv / h200.disk_bytes_per_s
    assert h200.ttft(tokens, disk) == pytest.approx(h200.ttft(tokens, host) + slower)
    half = [Load(tokens // 2, tokens // 2 * kv, "host")]
    expected = 0.5 * h200.full(tokens) + 0.5 * compute + tokens // 2 * kv / h200.h2d_bytes_per_s
    assert h200.ttft(tokens, half) == pytest.approx(expected)


def test_fifo_waits_grow_with_the_arrival_rate() -> None:
    service = [0.5] * 2000
    idle = fifo_ttfts(service, 0.01)
    assert statistics.fmean(idle) == pytest.approx(0.5, abs=0.01)
    waits = [statistics.fmean(fifo_ttfts(service, rate)) - 0.5 for rate in (0.8, 1.4, 1.8)]
    assert 0 < waits[0] < waits[1] < waits[2]
    # M/D/1 at utilisation 0.9: mean wait rho / (2 mu (1 - rho)) = 2.25 s.
    assert waits[2] == pytest.approx(2.25, rel=0.35)


def test_bad_values_are_refused() -> None:
    with pytest.raises(ValueError, match="increasing"):
        FusedPrefillTimes((4096, 1024), (1.0, 2.0), (0.5, 1.0), 5e10, 3e9)
    with pytest.raises(ValueError, match="two or more"):
        FusedPrefillTimes((4096,), (1.0,), (0.5,), 5e10, 3e9)
    with pytest.raises(ValueError, match="min_share"):
        FusedPrefillTimes((1024, 4096), (1.0, 2.0), (0.5, 1.0), 5e10, 3e9, min_share=2)
    with pytest.raises(ValueError, match="rate_per_s"):
        fifo_ttfts([1.0], 0)
