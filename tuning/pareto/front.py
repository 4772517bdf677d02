"""Pareto filter over objective vectors to minimise (latency, -throughput, cost)."""

from __future__ import annotations

import numpy as np


def pareto_mask(objectives: np.ndarray) -> np.ndarray:
    """True for rows not dominated by any other row (<= everywhere, < somewhere).

    Equal rows do not dominate each other, so duplicates are all kept.
    """
    f = np.asarray(objectives, dtype=float)
    if f.ndim != 2:
        raise ValueError("objectives must be a 2-D array (points x objectives)")
    if len(f) == 0:
        return np.zeros(0, dtype=bool)
    no_worse = (f[:, None, :] <= f[None, :, :]).all(axis=2)  # [j, i]: j no worse than i
    better = (f[:, None, :] < f[None, :, :]).any(axis=2)
    return ~(no_worse & better).any(axis=0)
