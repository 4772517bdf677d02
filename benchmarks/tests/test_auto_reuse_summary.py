"""What `benchmarks/auto_reuse.py` summarises, with and without the registered-corpus server."""

from __future__ import annotations

from typing import Any

from benchmarks.auto_reuse import summarise


def _row(all_seen: bool, seen_tokens: int, matched: int, fused: str, off: str) -> dict[str, Any]:
    return {
        "all_seen": all_seen,
        "seen_docs": 1 if seen_tokens else 0,
        "seen_document_tokens": seen_tokens,
        "chunk_tokens": matched,
        "fused_answer": fused,
        "off_answer": off,
        "fused_ttft_s": 1.0 if not all_seen else 0.5,
        "off_ttft_s": 1.0,
    }


ROWS = [_row(False, 0, 0, "a", "a"), _row(True, 100, 90, "b", "b"), _row(True, 100, 100, "c", "x")]


def test_seen_tokens_matched_and_agreement_with_the_registered_server() -> None:
    summary = summarise(ROWS, ["a", "x", "x"])
    assert summary["seen_document_tokens_matched"] == 0.95
    assert summary["ttft_ratio_median_per_request"] == 0.5
    assert summary["agreement_auto"] == 2 / 3
    assert summary["agreement_registered"] == 2 / 3


def test_without_the_registered_server_its_agreement_is_null() -> None:
    summary = summarise(ROWS, None)
    assert summary["agreement_registered"] is None
    assert summary["seen_document_tokens_matched"] == 0.95
