"""The TP table in docs/fusion-sglang.md is the one rendered from the committed
`benchmarks/results/tensor_parallel.json`: its figures cannot drift from the file."""

from __future__ import annotations

import json

from benchmarks.tensor_parallel import tensor_parallel_table
from benchmarks.tests.conftest import REPO


def test_doc_table_is_the_result_files() -> None:
    report = json.loads((REPO / "benchmarks/results/tensor_parallel.json").read_text())
    assert set(report["tp"]) == {"1", "2"}
    assert all(row["tp_ranks_agree"] == 2 for row in report["tp"]["2"]["prompts"])
    doc = (REPO / "docs/fusion-sglang.md").read_text()
    assert tensor_parallel_table(report) in doc
