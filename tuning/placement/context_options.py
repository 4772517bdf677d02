"""The options of one context for the placement, from its profile: per (tier, codec) the bytes
it takes there, the quality measured for the codec (the profiler's answer similarity to the
uncompressed answer, 1.0 for the dense rows), and the TTFT a request pays: the fused prefill's
compute plus moving the stored bytes off the tier at the tier's measured bandwidth (the ratio
tuner's tier profile; none for host memory). Recomputing is always an option, at the full
prefill's TTFT and full quality.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sglang_hicache_ext.tuning.placement.utility import UNCOMPRESSED, ContextProfile, Option


@dataclass(frozen=True)
class TierSpeed:
    name: str
    bytes_per_s: float | None  # None: in memory, nothing to move before the compute


@dataclass(frozen=True)
class ContextCosts:
    """What a context costs to serve, measured or estimated by the profiler."""

    stored_bytes: Mapping[str, int]  # per codec ("none" = dense rows)
    quality: Mapping[str, float]  # per codec, in [0, 1]
    fused_s: float  # the fused prefill's compute with every chunk in memory
    full_s: float  # the normal prefill (recomputing the context)


def context_profile(
    key: str, frequency: float, costs: ContextCosts, tiers: Sequence[TierSpeed]
) -> ContextProfile:
    """Every (tier, codec) option of a context, and recomputing it."""
    if set(costs.quality) != set(costs.stored_bytes) or UNCOMPRESSED not in costs.quality:
        raise ValueError(f"{key}: sizes and qualities must name the same codecs, dense included")
    options = [Option(None, UNCOMPRESSED, 0, 1.0, costs.full_s)]
    for tier in tiers:
        for codec, nbytes in costs.stored_bytes.items():
            move_s = 0.0 if tier.bytes_per_s is None else nbytes / tier.bytes_per_s
            options.append(
                Option(tier.name, codec, nbytes, costs.quality[codec], costs.fused_s + move_s)
            )
    return ContextProfile(key, frequency, tuple(options))
