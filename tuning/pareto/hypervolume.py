"""Exact hypervolume (minimisation) of a 3-D point set, by slicing along the last axis.

Between consecutive distinct third coordinates the dominated region is a prism whose section is
the 2-D hypervolume of the points already swept; O(n^2 log n), fine for a few hundred points.
"""

from __future__ import annotations

import numpy as np


def hypervolume(points: np.ndarray, reference: np.ndarray) -> float:
    """Volume dominated by `points` and bounded by `reference` (all objectives minimised)."""
    p = np.asarray(points, dtype=float).reshape(-1, len(reference))
    ref = np.asarray(reference, dtype=float)
    if ref.shape != (3,):
        raise ValueError("reference must have 3 coordinates")
    p = p[(p < ref).all(axis=1)]  # points not strictly better than the reference add nothing
    if len(p) == 0:
        return 0.0
    p = p[np.argsort(p[:, 2], kind="stable")]
    levels = np.append(np.unique(p[:, 2]), ref[2])
    volume = 0.0
    for low, high in zip(levels[:-1], levels[1:], strict=True):
        volume += hypervolume_2d(p[p[:, 2] <= low, :2], ref[:2]) * (high - low)
    return float(volume)


def hypervolume_2d(points: np.ndarray, reference: np.ndarray) -> float:
    p = np.asarray(points, dtype=float).reshape(-1, 2)
    p = p[(p < reference).all(axis=1)]
    if len(p) == 0:
        return 0.0
    p = p[np.lexsort((p[:, 1], p[:, 0]))]
    best_y = np.minimum.accumulate(p[:, 1])
    next_x = np.append(p[1:, 0], reference[0])
    return float(((next_x - p[:, 0]) * (reference[1] - best_y)).sum())


def reference_point(objectives: np.ndarray, margin: float = 0.1) -> np.ndarray:
    """A point strictly worse than every row: the worst value plus `margin` of each range."""
    f = np.asarray(objectives, dtype=float).reshape(-1, 3)
    if len(f) == 0:
        raise ValueError("no points to build a reference point from")
    worst, best = f.max(axis=0), f.min(axis=0)
    span = np.where(worst > best, worst - best, np.maximum(np.abs(worst), 1.0))
    return worst + margin * span
