"""Self-checks of `benchmarks/auto_reuse_limits.py`: its comparison across rounds and its stream."""

from __future__ import annotations

import pytest

from benchmarks.auto_reuse_limits import paired_ratio, unique_documents


def test_paired_ratio_compares_each_prompt_with_itself_across_rounds() -> None:
    # Prompt 0 is fast and prompt 1 slow on every server; round 2 is slower throughout. Each
    # prompt's median over rounds, on / off: 2.0 and 1.5; their median 1.75.
    off = [[1.0, 2.0], [1.2, 2.4], [1.0, 2.0]]
    on = [[2.0, 3.0], [2.4, 3.6], [2.0, 3.0]]
    assert paired_ratio(on, off) == pytest.approx(1.75)


def test_paired_ratio_refuses_rounds_of_different_lengths() -> None:
    with pytest.raises(ValueError):
        paired_ratio([[1.0, 2.0]], [[1.0]])


def test_a_shorter_stream_is_the_start_of_a_longer_one() -> None:
    short, long = unique_documents(40), unique_documents(400)
    assert short == long[:40]
    assert len(set(long)) == 400
