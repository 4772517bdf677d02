"""benchmarks/fusion_gpu.py runs on CPU with --small: full vs fused prefill, and the fused
prefill with its chunks read from host memory gives the same logits whichever way they are read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import fusion_gpu

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_small_benchmark_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "fusion_small.json"
    fusion_gpu.main(["--small", "--out", str(out), "--device", "cpu", "--ratios", "0.15"])
    report = json.loads(out.read_text())
    assert report["small"] is True and report["backends"] == ["torch"]
    (model,) = report["models"]
    assert model["layers"] == 4 and model["skipped_lengths"] == []
    (row,) = model["results"]
    assert row["tokens"] == 512 and row["full"]["torch"]["ttft_s"] > 0
    # The executor's full prefill is the model's own forward (fp32, same kernels).
    assert row["hf_forward"]["max_logit_diff_rel"] < 1e-4 and row["hf_forward"]["top1_agrees"]
    fused = row["fused"]["question_attention@0.15"]["torch"]
    expected = round(0.15 * row["chunk_tokens"])
    assert fused["selected"] == expected
    # Scored by a first pass, so every layer computes the selection and the non-chunk tokens.
    assert fused["computed_tokens_per_layer"] == [512 - row["chunk_tokens"] + expected] * 4
    assert fused["vs_full"]["max_logit_diff"] > 0  # an approximation of the full prefill
    host = row["host_loads_by_selector"]["question_attention"]
    variants = ("host_serial", "host_overlapped", "host_overlapped_sparse", "host_plain")
    assert all(host[name]["identical_to_gpu"] for name in variants)
    assert host["hidden_share"] is None  # no bus on the CPU
