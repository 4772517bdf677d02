"""Recompute-ratio tuning: the per-model quality floor (the lower bound of any tuned ratio)."""

from sglang_hicache_ext.tuning.ratio.quality_floor import (
    CurvePoint,
    QualityFloor,
    floor_from_curve,
    quality_floor,
    record_floor,
)

__all__ = ["CurvePoint", "QualityFloor", "floor_from_curve", "quality_floor", "record_floor"]
