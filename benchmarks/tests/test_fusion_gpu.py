"""benchmarks/fusion_gpu.py runs on CPU with --small and reports full vs fused prefill."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import fusion_gpu

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_small_benchmark_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "fusion_small.json"
    fusion_gpu.main(["--small", "--out", str(out), "--device", "cpu"])
    report = json.loads(out.read_text())
    assert report["small"] is True and report["model"]["layers"] == 4
    (row,) = report["results"]
    assert row["tokens"] == 512 and row["full_s"] > 0
    fused = row["fused"]
    assert set(fused) == {"a3", "freq", "cacheblend", "epic", "reuse"}
    non_chunk = 512 - row["chunk_tokens"]
    for name, result in fused.items():
        assert result["ttft_s"] > 0
        expected = 0 if name == "reuse" else round(0.15 * row["chunk_tokens"])
        assert result["selected"] == expected
        # After the check layer only the selection and the non-chunk tokens are computed.
        assert result["computed_tokens_per_layer"][-1] == non_chunk + expected
    # Check-layer selectors compute every token up to and including layer 1.
    assert fused["a3"]["computed_tokens_per_layer"][:2] == [512, 512]
    assert fused["freq"]["computed_tokens_per_layer"][0] == non_chunk + fused["freq"]["selected"]
    # Chunks lose their cross-attention under reuse; the fused runs approximate full prefill.
    assert fused["reuse"]["max_logit_diff_vs_full"] > 0
