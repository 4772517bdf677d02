"""The EvicPress placement: the utility function of §4.2 and the greedy knapsack of Algorithm 1
across tiers, on contexts whose sensitivity to compression differs."""

from __future__ import annotations

import itertools
import random

import pytest

from sglang_hicache_ext.tuning.placement.greedy import place
from sglang_hicache_ext.tuning.placement.utility import ContextProfile, Option, utility

MB = 1 << 20
# Load delay per MB by tier; recomputing costs the prefill.
DELAY_PER_MB = {"dram": 0.001, "disk": 0.02}
PREFILL_S = 2.0
CODECS = {"none": 1.0, "int8": 0.27, "int4": 0.15}  # stored fraction of the uncompressed size


def _context(
    key: str, size_mb: int, quality: dict[str, float], frequency: float = 1.0
) -> ContextProfile:
    options = [Option(None, "none", 0, 1.0, PREFILL_S)]
    for tier, codec in itertools.product(DELAY_PER_MB, CODECS):
        nbytes = int(size_mb * MB * CODECS[codec])
        delay = 0.05 + DELAY_PER_MB[tier] * nbytes / MB
        options.append(Option(tier, codec, nbytes, quality[codec], delay))
    return ContextProfile(key, frequency, tuple(options))


ROBUST = {"none": 1.0, "int8": 1.0, "int4": 0.98}  # compresses without losing answers
SENSITIVE = {"none": 1.0, "int8": 0.9, "int4": 0.4}


def test_utility_is_the_papers_formula() -> None:
    option = Option("dram", "int8", 10, quality=0.65, ttft_s=0.05)
    assert utility(option, alpha=1.0, frequency=1.0) == pytest.approx(0.6)
    assert utility(option, alpha=2.0, frequency=3.0) == pytest.approx((1.3 - 0.05) * 3)
    with pytest.raises(ValueError, match="alpha must be >= 0"):
        utility(option, alpha=-1.0, frequency=1.0)


def test_with_room_every_context_takes_its_best_option() -> None:
    contexts = [_context("a", 100, ROBUST), _context("b", 100, SENSITIVE)]
    placement = place(contexts, {"dram": 10**12, "disk": 10**12}, alpha=1.0)
    assert {k: (o.tier, o.codec) for k, o in placement.chosen.items()} == {
        "a": ("dram", "int8"),  # as good as uncompressed here, and faster to load
        "b": ("dram", "none"),
    }
    assert placement.moves == ()


@pytest.mark.parametrize("dram_mb", [60, 120, 200, 400])
@pytest.mark.parametrize("alpha", [0.5, 1.0, 4.0])
def test_capacities_hold_and_the_floor_is_never_crossed(dram_mb: int, alpha: float) -> None:
    rng = random.Random(dram_mb)
    contexts = [
        _context(
            f"c{i}", rng.choice([50, 100, 200]), rng.choice([ROBUST, SENSITIVE]), rng.random() * 5
        )
        for i in range(12)
    ]
    capacities = {"dram": dram_mb * MB, "disk": 600 * MB}
    placement = place(contexts, capacities, alpha=alpha, quality_floor=0.9)
    for tier, capacity in capacities.items():
        assert placement.used_bytes[tier] <= capacity
    assert all(o.quality >= 0.9 for o in placement.chosen.values())


def test_the_robust_context_is_compressed_before_the_sensitive_one_is_evicted() -> None:
    # DRAM holds one context uncompressed plus the other at int4 only.
    contexts = [_context("robust", 100, ROBUST), _context("sensitive", 100, SENSITIVE)]
    placement = place(contexts, {"dram": 120 * MB, "disk": 10**12}, alpha=1.0)
    chosen = {k: (o.tier, o.codec) for k, o in placement.chosen.items()}
    assert chosen["sensitive"] in {("dram", "none"), ("dram", "int8")}
    assert chosen["robust"][0] == "dram"


def test_when_nothing_fits_contexts_go_down_a_tier_then_are_recomputed() -> None:
    contexts = [_context(f"c{i}", 100, SENSITIVE, frequency=1.0 + i) for i in range(3)]
    placement = place(contexts, {"dram": 0, "disk": 30 * MB}, alpha=1.0, quality_floor=0.85)
    tiers = sorted((o.tier or "recompute", o.codec) for o in placement.chosen.values())
    # 30 MB of disk holds one context at int8 (27 MB); the others are recomputed.
    assert tiers == [("disk", "int8"), ("recompute", "none"), ("recompute", "none")]
    on_disk = next(k for k, o in placement.chosen.items() if o.tier == "disk")
    assert on_disk == "c2"  # the most frequent one keeps its place


def test_greedy_matches_the_exhaustive_optimum_on_small_cases() -> None:
    for seed in range(20):
        rng = random.Random(seed)
        contexts = [
            _context(
                f"c{i}", rng.choice([50, 100]), rng.choice([ROBUST, SENSITIVE]), rng.random() * 3
            )
            for i in range(3)
        ]
        capacities = {"dram": rng.choice([40, 80, 150]) * MB, "disk": rng.choice([30, 100]) * MB}
        greedy = place(contexts, capacities, alpha=1.0).total_utility
        best = max(
            sum(utility(o, 1.0, c.frequency) for o, c in zip(combo, contexts, strict=True))
            for combo in itertools.product(*(c.options for c in contexts))
            if all(
                sum(o.nbytes for o in combo if o.tier == tier) <= capacity
                for tier, capacity in capacities.items()
            )
        )
        assert greedy <= best + 1e-9
        assert best - greedy <= 0.1 * abs(best), (seed, greedy, best)


def test_a_context_without_the_recompute_option_is_refused() -> None:
    with pytest.raises(ValueError, match="must include recomputing"):
        ContextProfile("x", 1.0, (Option("dram", "none", 1, 1.0, 0.1),))


def test_context_options_cost_the_move_off_each_tier() -> None:
    from sglang_hicache_ext.tuning.placement.context_options import (
        ContextCosts,
        TierSpeed,
        context_profile,
    )

    costs = ContextCosts(
        stored_bytes={"none": 100 * MB, "int8": 27 * MB},
        quality={"none": 1.0, "int8": 0.97},
        fused_s=0.4,
        full_s=2.5,
    )
    tiers = [TierSpeed("host", None), TierSpeed("disk", 50 * MB)]
    profile = context_profile("c", 3.0, costs, tiers)
    ttft = {(o.tier, o.codec): o.ttft_s for o in profile.options}
    assert ttft == pytest.approx(
        {
            (None, "none"): 2.5,
            ("host", "none"): 0.4,
            ("host", "int8"): 0.4,
            ("disk", "none"): 0.4 + 2.0,
            ("disk", "int8"): 0.4 + 0.54,
        }
    )
    assert {(o.codec, o.quality) for o in profile.options if o.tier == "disk"} == {
        ("none", 1.0),
        ("int8", 0.97),
    }
    with pytest.raises(ValueError, match="dense included"):
        context_profile("c", 1.0, ContextCosts({"int8": 1}, {"int8": 1.0}, 0.1, 1.0), tiers)
