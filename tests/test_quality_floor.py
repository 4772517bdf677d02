"""The quality floor: smallest ratio kept from there up, stored and read back per model."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_hicache_ext.tuning.ratio import (
    CurvePoint,
    QualityFloor,
    floor_from_curve,
    quality_floor,
    record_floor,
)


def _curve(*retentions: float) -> tuple[CurvePoint, ...]:
    ratios = (0.05, 0.1, 0.15, 0.3)
    return tuple(
        CurvePoint(r, x, (x - 0.1, x + 0.1), 100) for r, x in zip(ratios, retentions, strict=True)
    )


@pytest.mark.parametrize(
    ("retentions", "floor"),
    [
        ((0.80, 0.90, 0.96, 0.99), 0.15),
        ((0.97, 0.90, 0.96, 0.99), 0.15),  # a lucky low ratio below a miss does not count
        ((0.96, 0.97, 0.98, 0.99), 0.05),
        ((0.80, 0.90, 0.93, 0.94), None),
        ((0.80, 0.96, 0.97, 0.90), None),  # the largest ratio misses: nothing is kept for sure
    ],
)
def test_floor_is_the_smallest_ratio_kept_from_there_up(
    retentions: tuple[float, ...], floor: float | None
) -> None:
    assert floor_from_curve(_curve(*retentions)) == floor


def test_floors_round_trip_per_model(tmp_path: Path) -> None:
    path = tmp_path / "floors.json"
    qwen = QualityFloor("qwen", "a3", 0.3, 0.95, _curve(0.8, 0.9, 0.93, 0.96), "bfloat16", "x")
    smol = QualityFloor("smol", "a3", None, 0.95, _curve(0.1, 0.2, 0.3, 0.4), "float32", "y")
    record_floor(qwen, path)
    record_floor(smol, path)
    assert quality_floor("qwen", path) == qwen
    assert quality_floor("smol", path) == smol
    assert quality_floor("llama", path) is None
    assert quality_floor("qwen", tmp_path / "missing.json") is None
