"""Recompute-ratio tuning: roofline model, warm-started golden-section search, ratio table."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sglang_hicache_ext.tuning.ratio.projection import (
    GPU_TIERS,
    H100_EFFECTIVE_FLOPS,
    LLAMA3_8B,
    project,
)
from sglang_hicache_ext.tuning.ratio.roofline import TierCosts, predicted_ttft, roofline_prior
from sglang_hicache_ext.tuning.ratio.search import golden_section
from sglang_hicache_ext.tuning.ratio.table import (
    RatioTable,
    TunedRatio,
    load_ratio_table,
    token_weighted_ratio,
)


@pytest.mark.parametrize("load_s", [0.0, 1e-7, 1e-6, 3e-6, 1e-4])
def test_prior_balances_load_and_recompute(load_s: float) -> None:
    costs = TierCosts(recompute_s=1e-6, load_s=load_s, overhead_s=1e-4)
    r0 = roofline_prior(costs)
    assert r0 == pytest.approx(load_s / (1e-6 + load_s))
    # At r0 the two paths of Eq. 9 take the same time, and no grid ratio beats it.
    assert r0 * 1e-6 == pytest.approx((1 - r0) * load_s)
    grid = np.linspace(0, 1, 201)
    best = min(predicted_ttft(costs, r, 4096, 24) for r in grid)
    assert predicted_ttft(costs, r0, 4096, 24) <= best + 1e-12
    # Without overlap the two paths add up: never faster.
    assert predicted_ttft(costs, r0, 4096, 24, overlapped=False) >= predicted_ttft(
        costs, r0, 4096, 24
    )


def test_prior_is_clipped_to_the_quality_floor() -> None:
    fast = TierCosts(recompute_s=1e-6, load_s=1e-8)
    assert roofline_prior(fast, r_min=0.5) == 0.5
    slow = TierCosts(recompute_s=1e-6, load_s=1e-3)
    assert roofline_prior(slow, r_min=0.15, r_max=0.8) == 0.8
    with pytest.raises(ValueError, match="r_min <= r_max"):
        roofline_prior(fast, r_min=0.6, r_max=0.5)
    with pytest.raises(ValueError, match="load_s must be finite"):
        roofline_prior(TierCosts(1e-6, -1.0))


def _roofline_objective(optimum: float, noise: float, seed: int):
    rng = np.random.default_rng(seed)
    costs = TierCosts(1.0, optimum / (1 - optimum), 0.05)

    def objective(r: float) -> float:
        return predicted_ttft(costs, r, 100, 4) * (1 + noise * rng.standard_normal())

    return objective


@pytest.mark.parametrize("optimum", [0.2, 0.35, 0.5, 0.7, 0.9])
@pytest.mark.parametrize("prior_offset", [-0.15, 0.0, 0.2])
@pytest.mark.parametrize("noise", [0.0, 0.01])
def test_search_finds_the_roofline_optimum(
    optimum: float, prior_offset: float, noise: float
) -> None:
    objective = _roofline_objective(optimum, noise, seed=int(optimum * 100))
    result = golden_section(objective, optimum + prior_offset, 0.15, 1.0, tolerance=0.01)
    assert result.ratio == pytest.approx(optimum, abs=0.03 + 2 * noise)
    # The first probe is the prior (half a tolerance inside a bound it was clipped to).
    assert (
        abs(result.probes[0].ratio - min(max(optimum + prior_offset, 0.15), 1.0)) <= 0.005 + 1e-12
    )
    # One evaluation per step: about log_{1/phi}(width / tolerance) + 2 of them.
    assert len(result.probes) <= 14


def test_warm_start_at_the_optimum_needs_no_more_evaluations_than_a_cold_start() -> None:
    objective = _roofline_objective(0.4, 0.0, 0)
    warm = golden_section(objective, 0.4, 0.15, 1.0, tolerance=0.01)
    cold = golden_section(objective, 0.15 + 0.382 * 0.85, 0.15, 1.0, tolerance=0.01)
    assert abs(warm.ratio - 0.4) <= abs(cold.ratio - 0.4) + 1e-3
    assert warm.best_probe.ratio == 0.4


@pytest.mark.parametrize("prior", [0.15, 0.3, 1.0])
def test_a_monotone_objective_ends_at_its_bound(prior: float) -> None:
    # The bound itself is evaluated and returned, not the last bracket's midpoint above it.
    rising = golden_section(lambda r: r, prior, 0.15, 1.0, tolerance=0.01)
    assert rising.ratio == 0.15 and rising.best_probe.ratio == 0.15
    falling = golden_section(lambda r: -r, prior, 0.15, 1.0, tolerance=0.01)
    assert falling.ratio == 1.0
    assert all(0.15 <= p.ratio <= 1.0 for p in rising.probes + falling.probes)


def test_search_refuses_bad_bounds_and_values() -> None:
    with pytest.raises(ValueError, match="r_min <= r_max"):
        golden_section(lambda r: r, 0.5, 0.8, 0.2)
    with pytest.raises(ValueError, match="not finite"):
        golden_section(lambda r: float("nan"), 0.5, 0.1, 0.9)


def _table() -> RatioTable:
    return RatioTable(
        "tiny",
        {
            "host": TunedRatio(0.15, 0.02, 0.15, 1.0, "golden-section search"),
            "disk": TunedRatio(0.45, 0.5, 0.15, 1.0, "golden-section search"),
        },
    )


def test_a_request_mixing_tiers_gets_the_token_weighted_ratio(tmp_path: Path) -> None:
    table = _table()
    assert table.ratio_for({"host": 300}) == 0.15
    # One tier's chunks get exactly its ratio, whatever their count (0.4 * 3 / 3 is not 0.4).
    assert token_weighted_ratio({"disk": 0.4}, {"disk": 3}) == 0.4
    assert all(token_weighted_ratio({"d": 0.4}, {"d": n}) == 0.4 for n in range(1, 2000))
    assert table.ratio_for({"host": 100, "disk": 300}) == pytest.approx(0.375)
    with pytest.raises(KeyError, match="mooncake"):
        table.ratio_for({"mooncake": 10})
    path = tmp_path / "ratios.json"
    table.save(path)
    assert load_ratio_table(path) == table


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("not json", "not a ratio table"),
        ('{"model": "m"}', "not a ratio table"),
        ('{"model": "m", "tiers": {}}', "no tiers"),
        (
            '{"model": "m", "tiers": {"host": {"ratio": 2, "prior": 0, "r_min": 0, "r_max": 1, '
            '"source": "x"}}}',
            "outside",
        ),
        (
            '{"model": "m", "tiers": {"host": {"ratio": 0.1, "prior": 0, "r_min": 0.5, "r_max": 1, '
            '"source": "x"}}}',
            "below its floor",
        ),
    ],
)
def test_a_bad_ratio_table_is_one_line(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "ratios.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match) as err:
        load_ratio_table(path)
    assert "\n" not in str(err.value)


def test_gpu_projection_orders_tiers_by_bandwidth() -> None:
    rows = project(LLAMA3_8B, H100_EFFECTIVE_FLOPS, GPU_TIERS, 4096, r_min=0.15)
    priors = [row.prior for row in rows]
    assert priors == sorted(priors) and priors[0] == 0.15 and priors[-1] > 0.9
    # Llama-3-8B keeps 8 KV heads of 128 in bf16: 4 KiB per token and layer.
    assert LLAMA3_8B.kv_bytes_per_token_layer == 4096
    for row in rows:
        assert row.ttft_at_prior_s <= min(row.ttft_at_r_min_s, row.full_prefill_s) + 1e-12
    json.dumps([row._asdict() for row in rows])
