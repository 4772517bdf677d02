"""Subtree grouping: shared-prefix detection, top-K selection, access recorder statistics."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_hicache_ext.radix.access_recorder import AccessRecorder
from sglang_hicache_ext.radix.groups import (
    RESIDUAL_GROUP,
    SHARED_PREFIX_GROUP,
    SubtreeGrouping,
    select_top_subtrees,
    subtree_group_name,
)
from sglang_hicache_ext.radix.shared_prefix import find_shared_prefix, subtree_roots


def test_shared_prefix_stops_at_first_branching() -> None:
    paths = [("sys", "p2", f"u{i}", "x") for i in range(9)] + [("other", "y")]
    assert find_shared_prefix(paths, min_share=0.9) == ("sys", "p2")
    assert find_shared_prefix(paths, min_share=0.95) == ()
    assert subtree_roots(("sys", "p2", "u3", "x"), ("sys", "p2")) == [None, None, "u3", "u3"]
    assert subtree_roots(("other", "y"), ("sys", "p2")) == ["other", "other"]
    assert subtree_roots(("sys",), ("sys", "p2")) == [None]


def test_top_k_selection_is_deterministic_and_skips_unused() -> None:
    reuse = {"a": 5, "b": 9, "c": 5, "d": 0}
    assert select_top_subtrees(reuse, 2) == frozenset({"b", "a"})  # tie a/c broken by name
    assert select_top_subtrees(reuse, 10) == frozenset({"a", "b", "c"})
    with pytest.raises(ValueError):
        select_top_subtrees(reuse, -1)


def planted_trace(seed: int = 0) -> tuple[list[tuple[float, tuple[str, ...]]], set[str]]:
    """Every request starts with the system block "S"; three planted conversations are reused
    much more often than 200 one-off conversations."""
    rng = np.random.default_rng(seed)
    requests: list[tuple[float, tuple[str, ...]]] = []
    hot = {"hotA": 40, "hotB": 30, "hotC": 20}
    for name, turns in hot.items():
        for turn in range(turns):
            time = float(rng.uniform(0, 1000))
            depth = 1 + turn % 5
            requests.append((time, ("S", name, *[f"{name}.{d}" for d in range(depth)])))
    for i in range(200):
        for turn in range(int(rng.integers(1, 3))):  # at most one reuse each
            requests.append((float(rng.uniform(0, 1000)), ("S", f"cold{i}", f"cold{i}.{turn}")))
    requests.sort()
    return requests, set(hot)


def test_grouping_finds_planted_subtrees_below_the_shared_block() -> None:
    requests, hot = planted_trace()
    recorder = AccessRecorder()
    for time, pages in requests:
        recorder.record_request(time, pages)
    stats = recorder.window_stats(k=3)
    assert stats.grouping.spine == ("S",)
    assert stats.grouping.top_subtrees == frozenset(hot)
    assert stats.grouping.groups_of_path(("S", "hotA", "hotA.0")) == [
        SHARED_PREFIX_GROUP,
        subtree_group_name("hotA"),
        subtree_group_name("hotA"),
    ]
    assert stats.grouping.groups_of_path(("S", "cold3")) == [SHARED_PREFIX_GROUP, RESIDUAL_GROUP]
    # Every access is either a first access of a page or one reuse interval.
    total_pages = sum(r.unique_pages for r in stats.reuse.values())
    total_intervals = sum(r.intervals.size for r in stats.reuse.values())
    assert total_pages + total_intervals == stats.accesses == sum(len(p) for _, p in requests)
    assert stats.reuse[SHARED_PREFIX_GROUP].unique_pages == 1
    assert stats.reuse[SHARED_PREFIX_GROUP].intervals.size == len(requests) - 1


def test_reuse_intervals_hand_computed() -> None:
    recorder = AccessRecorder()
    recorder.record_request(0.0, ("S", "a", "a1"))
    recorder.record_request(10.0, ("S", "b"))
    recorder.record_request(15.0, ("S", "a", "a1", "a2"))
    recorder.record_request(40.0, ("S", "a"))
    stats = recorder.window_stats(k=1)
    a = stats.reuse[subtree_group_name("a")]
    assert a.unique_pages == 3  # a, a1, a2
    assert a.intervals.tolist() == [15.0, 15.0, 25.0]  # a: 0->15->40, a1: 0->15
    assert stats.reuse[RESIDUAL_GROUP].intervals.size == 0
    assert stats.reuse[RESIDUAL_GROUP].unique_pages == 1  # b
    assert stats.reuse[SHARED_PREFIX_GROUP].intervals.tolist() == [5.0, 10.0, 25.0]  # sorted
    history = recorder.page_history("a1")
    assert history.subtree_root == "a" and history.times == (0.0, 15.0)
    # A window sees only its own requests; forgetting drops old ones.
    assert recorder.window_stats(1, 10.0, 41.0).reuse[SHARED_PREFIX_GROUP].intervals.size == 2
    recorder.forget_before(12.0)
    assert len(recorder) == 2
    with pytest.raises(ValueError):
        recorder.record_request(1.0, ("S",))


def test_recent_window_ranks_active_subtrees() -> None:
    recorder = AccessRecorder()
    for t in range(10):  # "old" reused a lot, long ago
        recorder.record_request(float(t), ("S", "old"))
    for t in (100.0, 101.0, 102.0):  # "new" reused recently
        recorder.record_request(t, ("S", "new"))
    assert recorder.window_stats(1).grouping.top_subtrees == {"old"}
    assert recorder.window_stats(1, rank_from_s=50.0).grouping.top_subtrees == {"new"}
    given = SubtreeGrouping(("S",), frozenset({"old"}))
    assert recorder.window_stats(1, 50.0, 200.0, grouping=given).grouping == given
