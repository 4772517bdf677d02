"""The searched space: a fine grid and the coarser start of the adaptive search over it."""

from __future__ import annotations

from sglang_hicache_ext.tuning.pareto.adaptive import AdaptiveSettings
from sglang_hicache_ext.tuning.pareto.space import Axis, Space

DEFAULT_DISKS = ("essd_pl1", "essd_pl2", "essd_pl3")


def grid_space(
    dram_max_gb: float = 1024,
    dram_step_gb: float = 64,
    ttl_max_s: float = 1800,
    ttl_step_s: float = 300,
    disks: tuple[str, ...] = DEFAULT_DISKS,
) -> Space:
    return Space(Axis(0, dram_max_gb, dram_step_gb), Axis(0, ttl_max_s, ttl_step_s), disks)


def adaptive_settings(grid: Space) -> AdaptiveSettings:
    """Start from half the DRAM range at 4x the grid's DRAM step and 3x its TTL step (the
    paper's shape: coarse and narrower in DRAM, expanded while it pays); refine down to the
    grid's own steps."""
    coarse = Space(
        Axis(0, grid.dram.hi / 2, 4 * grid.dram.step),
        Axis(0, grid.ttl.hi, 3 * grid.ttl.step),
        grid.disks,
    )
    return AdaptiveSettings(
        coarse=coarse,
        dram_limit_gb=grid.dram.hi,
        dram_step_gb=grid.dram.step,
        ttl_step_s=grid.ttl.step,
    )
