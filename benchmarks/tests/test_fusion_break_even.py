"""The break-even share `benchmarks/fusion_break_even.py` reports: where the fused arm's paired
TTFT ratio falls to the fallback arm's, and whether that lies below every share measured."""

from __future__ import annotations

from typing import Any

from benchmarks.fusion_break_even import summarise


def _rows(seen: int, share: float, fused_ratio: float, fused: bool) -> list[dict[str, Any]]:
    return [
        {
            "seen": seen,
            "prompt_tokens": 1000,
            "chunk_tokens": int(share * 1000),
            "reused_rows": int(share * 850),
            "fused": fused,
            "fused_ttft_s": fused_ratio,
            "off_ttft_s": 1.0,
        }
    ]


def _summary(fused_ratios: dict[int, float]) -> dict[str, Any]:
    shares = {0: 0.0, 1: 0.1, 2: 0.2, 3: 0.3}
    fused = [row for s, r in fused_ratios.items() for row in _rows(s, shares[s], r, s > 0)]
    fallback = [row for s in fused_ratios for row in _rows(s, 0.0, 1.0, False)]
    return summarise({"fused": fused, "fallback": fallback})


def test_crossing_between_two_shares_is_interpolated() -> None:
    summary = _summary({0: 1.0, 1: 1.1, 2: 0.9, 3: 0.8})
    assert abs(summary["break_even_matched_share"] - 0.15) < 1e-9
    assert summary["break_even_below_lowest_share"] is False


def test_fused_faster_at_every_share_is_an_upper_bound() -> None:
    summary = _summary({0: 1.0, 1: 0.97, 2: 0.9, 3: 0.8})
    assert summary["break_even_matched_share"] == 0.1
    assert summary["break_even_below_lowest_share"] is True


def test_fused_never_faster_has_no_break_even() -> None:
    summary = _summary({0: 1.0, 1: 1.2, 2: 1.1, 3: 1.05})
    assert summary["break_even_matched_share"] is None
    assert summary["break_even_below_lowest_share"] is False
