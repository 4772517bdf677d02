"""Tuned recompute ratios per chunk tier of one model, and the ratio of a request that mixes tiers.

Written by `python -m sglang_hicache_ext.tuning.ratio tune`, read by the server when
`fusion_recompute_ratio` is "auto" (setting `fusion_ratio_table`). A request whose chunks are
loaded from several tiers gets the token-weighted mean of their tiers' ratios: the recompute
budget is the sum of what each chunk's tier asks for, and the selector spends it where the
scores are.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple


def token_weighted_ratio(ratios: Mapping[str, float], tokens_by_tier: Mapping[str, int]) -> float:
    """The mean of the tiers' `ratios` weighted by `tokens_by_tier` (a positive total): a request
    mixing tiers spends the sum of what each chunk's tier asks for. Kept inside the tiers' own
    range, so chunks of one tier get exactly its ratio (the division alone can miss it by one
    ulp, and the response reports the ratio: 0.4 * 3 / 3 is 0.4000000000000001)."""
    used = [ratios[tier] for tier in tokens_by_tier]
    total = sum(tokens_by_tier.values())
    mean = sum(ratios[tier] * n for tier, n in tokens_by_tier.items()) / total
    return min(max(used), max(min(used), mean))


class TunedRatio(NamedTuple):
    ratio: float  # what "auto" uses for chunks loaded from this tier
    prior: float  # the roofline prior r0 the search started from
    r_min: float  # the model's quality floor (no tuned ratio goes below it)
    r_max: float
    source: str  # how it was found: "golden-section search", "roofline prior", ...


class RatioTable(NamedTuple):
    model: str
    tiers: dict[str, TunedRatio]

    def ratio_for(self, tokens_by_tier: Mapping[str, int]) -> float:
        """Token-weighted ratio of one request's chunks; KeyError names a tier not tuned."""
        missing = sorted(tier for tier in tokens_by_tier if tier not in self.tiers)
        if missing:
            raise KeyError(
                f"no tuned ratio for chunk tier(s) {', '.join(missing)} "
                f"(tuned: {', '.join(sorted(self.tiers)) or 'none'})"
            )
        if sum(tokens_by_tier.values()) <= 0:
            return max(t.ratio for t in self.tiers.values())
        ratios = {tier: self.tiers[tier].ratio for tier in tokens_by_tier}
        return min(1.0, token_weighted_ratio(ratios, tokens_by_tier))

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "tiers": {t: r._asdict() for t, r in self.tiers.items()}}

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n")


def load_ratio_table(path: Path) -> RatioTable:
    """The table in `path`; ValueError (one line) for a file that is not one."""
    try:
        data = json.loads(Path(path).read_text())
        tiers = {name: TunedRatio(**entry) for name, entry in data["tiers"].items()}
        table = RatioTable(str(data["model"]), tiers)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{path} is not a ratio table: {err}") from None
    for name, tuned in tiers.items():
        values = (tuned.ratio, tuned.prior, tuned.r_min, tuned.r_max)
        if not all(isinstance(v, int | float) and math.isfinite(v) and 0 <= v <= 1 for v in values):
            raise ValueError(f"{path}: tier {name!r} has a ratio outside [0, 1]: {tuned}")
        if tuned.ratio < tuned.r_min:
            raise ValueError(f"{path}: tier {name!r} ratio {tuned.ratio} is below its floor")
    if not tiers:
        raise ValueError(f"{path}: the ratio table has no tiers")
    return table
