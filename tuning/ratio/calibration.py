"""Profile a (model, tier) on a running server and tune its recompute ratio (CacheTune §4.3).

`profile_tier` measures the roofline's inputs: t_c and t_o from a least-squares line through
normal-prefill TTFTs at several prompt lengths (per layer), t_i from the server's own timing of
the rows it reads from the tier (`load.read_s`, fused requests at r = 0 without overlap) or, for
host memory, from copying rows of the same size here. `tune_tier` runs the warm-started
golden-section search with the mean TTFT over the calibration prompts as the objective.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from sglang_hicache_ext.tuning.ratio.roofline import TierCosts, roofline_prior
from sglang_hicache_ext.tuning.ratio.search import SearchResult, golden_section
from sglang_hicache_ext.tuning.ratio.server_probe import (
    CalibrationPrompt,
    chunk_geometry,
    full_prefill,
    fused,
    median_fused_ttft,
    register,
)
from sglang_hicache_ext.tuning.ratio.table import TunedRatio

DEFAULT_R_MIN = 0.15  # CacheTune's quality bound, for models without a measured floor
LENGTH_FRACTIONS = (0.25, 0.5, 1.0)  # prompt prefixes the recompute line is fitted through


class TierProfile(NamedTuple):
    model: str
    tier: str
    layers: int
    kv_bytes_per_token_layer: float
    costs: TierCosts  # seconds per token per layer
    prefill_points: tuple[tuple[int, float], ...]  # (prompt tokens, normal-prefill TTFT s)
    load_source: str  # how t_i was measured

    def to_json(self) -> dict[str, Any]:
        return {**self._asdict(), "costs": self.costs._asdict()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TierProfile:
        fields = {**data, "costs": TierCosts(**data["costs"])}
        fields["prefill_points"] = tuple(tuple(p) for p in data["prefill_points"])
        return cls(**fields)


def host_copy_seconds(bytes_per_row: float, rows: int = 4096, repeats: int = 20) -> float:
    """Seconds to gather one row of `bytes_per_row` from host memory (what a host tier costs)."""
    width = max(1, round(bytes_per_row / 4))
    source = torch.randn(rows * 2, width)
    index = torch.arange(0, rows * 2, 2)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        source.index_select(0, index)
        times.append(time.perf_counter() - began)
    return statistics.median(times) / rows


def profile_tier(
    url: str, model: str, tier: str, prompts: Sequence[CalibrationPrompt]
) -> TierProfile:
    register(url, prompts)
    layers, row_bytes = chunk_geometry(url)
    points = []
    for prompt in prompts:
        for fraction in LENGTH_FRACTIONS:
            seconds, tokens = full_prefill(url, prompt.text[: int(len(prompt.text) * fraction)])
            points.append((tokens, seconds))
    slope, intercept = np.polyfit([p[0] for p in points], [p[1] for p in points], 1)
    runs = [
        fused(url, p.text, tier, selector="reuse", recompute_ratio=0.0, overlap_loads=False)
        for p in prompts
    ]
    loads = [run.info["load"] for run in runs if "load" in run.info]
    if loads:
        token_layers = sum(load["bytes_read"] for load in loads) / row_bytes
        load_s = sum(load["read_s"] for load in loads) / token_layers
        source = "server-timed reads of the tier (load.read_s), r = 0, no overlap"
    else:
        load_s = host_copy_seconds(row_bytes)
        source = "row gathers in host memory, timed in the profiler"
    costs = TierCosts(
        recompute_s=max(float(slope), 0.0) / layers,
        load_s=load_s,
        overhead_s=max(float(intercept), 0.0) / layers,
    )
    return TierProfile(model, tier, layers, row_bytes, costs.check(), tuple(points), source)


def tune_tier(
    url: str,
    prompts: Sequence[CalibrationPrompt],
    profile: TierProfile,
    r_min: float,
    r_max: float = 1.0,
    tolerance: float = 0.02,
    **options: Any,
) -> SearchResult:
    """Algorithm 1 on the server: f(r) = median fused TTFT over `prompts` from the tier."""
    register(url, prompts)
    prior = roofline_prior(profile.costs, r_min, r_max)

    def objective(ratio: float) -> float:
        return median_fused_ttft(url, prompts, profile.tier, recompute_ratio=ratio, **options)

    return golden_section(objective, prior, r_min, r_max, tolerance)


def tuned_ratio(result: SearchResult, prompts: int) -> TunedRatio:
    r_min, r_max = result.bounds
    return TunedRatio(
        round(result.ratio, 4),
        round(result.prior, 4),
        r_min,
        r_max,
        f"golden-section search from the roofline prior, {len(result.probes)} evaluations of "
        f"the median TTFT over {prompts} prompts",
    )
