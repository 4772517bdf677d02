"""The "Supported models" table in docs/fusion-sglang.md is the one rendered from the committed
`benchmarks/results/model_families.json`: its figures cannot drift from the file."""

from __future__ import annotations

import json

from benchmarks.model_families import families_table
from benchmarks.tests.conftest import REPO
from sglang_hicache_ext.evaluation.tiny_families import FAMILIES


def test_doc_table_is_the_result_files() -> None:
    result = json.loads((REPO / "benchmarks/results/model_families.json").read_text())
    assert set(result["families"]) == set(FAMILIES)  # every family measured
    doc = (REPO / "docs/fusion-sglang.md").read_text()
    assert families_table(result) in doc
