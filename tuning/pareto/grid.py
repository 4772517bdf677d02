"""Baseline: simulate every point of a uniform grid."""

from __future__ import annotations

from sglang_hicache_ext.tuning.pareto.evaluator import Evaluation, PointEvaluator
from sglang_hicache_ext.tuning.pareto.space import Space


def grid_search(space: Space, evaluator: PointEvaluator) -> list[Evaluation]:
    return evaluator.evaluate(space.grid())
