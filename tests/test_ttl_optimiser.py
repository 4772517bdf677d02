"""H_g, C_g, the surrogate and the budgeted TTL optimiser (group and fixed)."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_hicache_ext.tuning.ttl.optimiser import solve_fixed_ttl, solve_group_ttls
from sglang_hicache_ext.tuning.ttl.profile import GroupProfile, merge_profiles
from sglang_hicache_ext.tuning.ttl.profile_set import ProfileSet

# 3 unique pages, reuse intervals 1, 2, 2, 5 seconds.
HAND = GroupProfile.build("g", np.array([5.0, 2.0, 1.0, 2.0]), unique_pages=3)


@pytest.mark.parametrize(
    ("ttl", "hits", "cost"),
    [
        (0.0, 0, 0.0),
        (1.0, 1, 3 * 1 + (1 + 1 + 1 + 1)),  # 7
        (2.0, 3, 3 * 2 + (1 + 2 + 2 + 2)),  # 13
        (3.0, 3, 3 * 3 + (1 + 2 + 2 + 3)),  # 17
        (5.0, 4, 3 * 5 + (1 + 2 + 2 + 5)),  # 25
        (10.0, 4, 3 * 10 + 10),  # 40: every interval covered, tails grow
    ],
)
def test_hits_and_cost_hand_computed(ttl: float, hits: int, cost: float) -> None:
    assert HAND.hits(ttl) == hits
    assert HAND.cost(ttl) == pytest.approx(cost)


def test_cost_inverse_slope_and_roi_hand_computed() -> None:
    assert HAND.ttl_for_cost(13.0) == pytest.approx(2.0)
    assert HAND.ttl_for_cost(15.0) == pytest.approx(2.5)  # slope 4 on [2, 5]: 13 + 4 * 0.5
    assert HAND.ttl_for_cost(40.0) == pytest.approx(10.0)
    assert HAND.ttl_for_cost(1e9, max_ttl=60.0) == 60.0
    assert HAND.cost_slope(2.0) == 4  # 3 tails + the one interval still open (5)
    # ROI H/C at the jumps: 1/7, 3/13, 4/25 -> t = 2.
    assert HAND.roi_optimal_ttl() == 2.0
    with pytest.raises(ValueError):
        HAND.ttl_for_cost(-1.0)


def test_surrogate_is_monotone_with_the_right_limits() -> None:
    profile = GroupProfile.build("g", np.array([0.0, 0.0, 3.0, 30.0, 300.0]), unique_pages=4)
    ttls = np.geomspace(1e-3, 1e5, 200)
    smooth = np.array([profile.smooth_hits(t) for t in ttls])
    assert np.all(np.diff(smooth) >= 0)
    assert smooth[0] == pytest.approx(2.0, abs=1e-6)  # zero intervals hit at any TTL
    assert smooth[-1] == pytest.approx(5.0, abs=1e-6)
    t, h = 20.0, 1e-4
    numeric = (profile.smooth_hits(t + h) - profile.smooth_hits(t - h)) / (2 * h)
    assert profile.smooth_hits_slope(t) == pytest.approx(numeric, rel=1e-4)


def test_profile_set_agrees_with_profiles() -> None:
    rng = np.random.default_rng(1)
    profiles = [
        GroupProfile.build(f"g{i}", rng.exponential(10.0 ** (i + 1), 50).round(), 20 + i)
        for i in range(3)
    ] + [GroupProfile.build("empty", np.empty(0), 5)]
    group_set = ProfileSet(profiles)
    for ttls in (np.zeros(4), np.array([5.0, 50.0, 500.0, 7.0]), np.full(4, 1e6)):
        assert group_set.hits(ttls).tolist() == [
            p.hits(t) for p, t in zip(profiles, ttls, strict=True)
        ]
        np.testing.assert_allclose(
            group_set.cost(ttls), [p.cost(t) for p, t in zip(profiles, ttls, strict=True)]
        )
        np.testing.assert_allclose(
            group_set.smooth_hits(ttls),
            [p.smooth_hits(t) for p, t in zip(profiles, ttls, strict=True)],
        )


def synthetic_groups() -> list[GroupProfile]:
    rng = np.random.default_rng(7)
    return [
        GroupProfile.build("fast", rng.lognormal(np.log(20), 0.4, 400), 60),
        GroupProfile.build("slow", rng.lognormal(np.log(600), 0.4, 300), 80),
        GroupProfile.build("mixed", rng.lognormal(np.log(100), 1.5, 500), 300),
        GroupProfile.build("residual", rng.lognormal(np.log(300), 1.2, 800), 2000),
    ]


@pytest.mark.parametrize("fraction", [0.05, 0.2, 0.6])
def test_group_optimiser_meets_budget_and_beats_fixed(fraction: float) -> None:
    groups = synthetic_groups()
    full = sum(p.cost(3600.0) for p in groups)
    budget = fraction * full
    group = solve_group_ttls(groups, budget, max_ttl=3600.0, top_k=3)
    fixed = solve_fixed_ttl(groups, budget, max_ttl=3600.0)
    assert 0.99 * budget <= group.cost <= budget
    assert 0.99 * budget <= fixed.cost <= budget
    assert group.hits >= fixed.hits
    assert group.starts == 1 + 1 + 2  # floor(sqrt(3)) + 1, plus fixed and hull starts
    assert group.hits == sum(p.hits(group.ttls[p.name]) for p in groups)


def test_group_optimiser_finds_the_planted_optimum() -> None:
    # A: 100 pages reused after exactly 10 s; B: reused after 1000 s. C_A(10) = 2000. With a
    # budget of 2100 the optimum keeps A (100 hits) and gives B nothing; one TTL gets 0 hits.
    a = GroupProfile.build("A", np.full(100, 10.0), 100)
    b = GroupProfile.build("B", np.full(100, 1000.0), 100)
    group = solve_group_ttls([a, b], 2100.0, max_ttl=3600.0, top_k=1)
    assert group.hits == 100 and group.ttls["A"] >= 10.0 and group.cost <= 2100.0
    assert solve_fixed_ttl([a, b], 2100.0).hits == 0


def test_single_group_reduces_to_fixed_ttl() -> None:
    merged = merge_profiles(synthetic_groups())
    budget = 0.3 * merged.cost(3600.0)
    group = solve_group_ttls([merged], budget, max_ttl=3600.0, top_k=0)
    fixed = solve_fixed_ttl([merged], budget, max_ttl=3600.0)
    assert group.ttls["all"] == pytest.approx(fixed.ttls["all"], rel=1e-6)
    assert group.hits == fixed.hits


def test_bad_budgets_are_rejected() -> None:
    with pytest.raises(ValueError):
        solve_group_ttls(synthetic_groups(), -1.0, max_ttl=3600.0)
    with pytest.raises(ValueError):
        solve_fixed_ttl(synthetic_groups(), float("nan"))
    zero = solve_group_ttls(synthetic_groups(), 0.0, max_ttl=3600.0)
    assert zero.cost == 0.0
