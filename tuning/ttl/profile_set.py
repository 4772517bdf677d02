"""All groups' H, C and surrogate evaluated at once (vectorised across groups for the optimiser).

Same definitions as `GroupProfile`, which stays the readable per-group reference; tests check the
two agree.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.special import ndtr

from sglang_hicache_ext.tuning.ttl.profile import GroupProfile

_TINY_TTL = 1e-6


class ProfileSet:
    """Immutable bundle of group profiles; every method takes one TTL per group."""

    def __init__(self, profiles: Sequence[GroupProfile]) -> None:
        self.profiles = tuple(profiles)
        sizes = np.array([p.intervals.size for p in self.profiles], dtype=np.int64)
        self._offsets = np.concatenate(([0], np.cumsum(sizes)))[:-1]
        self._sizes = sizes
        deltas = [p.intervals for p in self.profiles]
        all_deltas = np.concatenate(deltas) if deltas else np.empty(0)
        # Sorting group by group with one searchsorted: key = group * stride + delta.
        self._stride = float(all_deltas.max() + 1.0) if all_deltas.size else 1.0
        group_of = np.repeat(np.arange(len(self.profiles)), sizes)
        self._keys = group_of * self._stride + all_deltas
        self._cumsum = np.concatenate(([0.0], np.cumsum(all_deltas)))
        self._pages = np.array([p.unique_pages for p in self.profiles], dtype=np.float64)
        self._zero = np.array([p.zero_intervals for p in self.profiles], dtype=np.float64)
        self._log_group = np.concatenate(
            [np.full(p.log_values.size, g) for g, p in enumerate(self.profiles)] or [np.empty(0)]
        ).astype(np.int64)
        self._log_values = np.concatenate([p.log_values for p in self.profiles] or [np.empty(0)])
        self._log_counts = np.concatenate([p.log_counts for p in self.profiles] or [np.empty(0)])
        bandwidths = np.array([p.bandwidth for p in self.profiles], dtype=np.float64)
        self._bandwidths = bandwidths
        self._log_bandwidth = bandwidths[self._log_group] if self._log_group.size else np.empty(0)

    def __len__(self) -> int:
        return len(self.profiles)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.profiles]

    @property
    def reuse_events(self) -> int:
        return int(self._sizes.sum())

    def hits(self, ttls: np.ndarray) -> np.ndarray:
        return self._covered(ttls)

    def cost(self, ttls: np.ndarray) -> np.ndarray:
        ttls = np.asarray(ttls, dtype=np.float64)
        covered = self._covered(ttls)
        covered_sum = self._cumsum[self._offsets + covered] - self._cumsum[self._offsets]
        return self._pages * ttls + covered_sum + ttls * (self._sizes - covered)

    def cost_slope(self, ttls: np.ndarray) -> np.ndarray:
        return self._pages + self._sizes - self._covered(ttls)

    def smooth_hits(self, ttls: np.ndarray) -> np.ndarray:
        z = self._z(ttls)
        per_value = self._log_counts * ndtr(z)
        return self._zero + np.bincount(self._log_group, per_value, minlength=len(self))

    def smooth_hits_slope(self, ttls: np.ndarray) -> np.ndarray:
        z = self._z(ttls)
        density = self._log_counts * np.exp(-0.5 * z * z) / np.sqrt(2.0 * np.pi)
        per_group = np.bincount(self._log_group, density, minlength=len(self))
        return per_group / (self._bandwidths * np.maximum(ttls, _TINY_TTL))

    def _covered(self, ttls: np.ndarray) -> np.ndarray:
        clipped = np.minimum(np.asarray(ttls, dtype=np.float64), self._stride - 1.0)
        queries = np.arange(len(self)) * self._stride + clipped
        return np.searchsorted(self._keys, queries, side="right") - self._offsets

    def _z(self, ttls: np.ndarray) -> np.ndarray:
        logs = np.log(np.maximum(np.asarray(ttls, dtype=np.float64), _TINY_TTL))
        return (logs[self._log_group] - self._log_values) / self._log_bandwidth
