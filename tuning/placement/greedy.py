"""Placement of every context across tiers by the greedy multi-choice knapsack of EvicPress
(Algorithm 1, §A; §4.4).

Each context starts at its best-utility option. While the fastest tier is over its capacity,
the single change with the least utility drop among the contexts on it is applied: a smaller
(more compressed) option on the same tier, or an option on a slower tier, or recomputing; then
the next tier is settled the same way (contexts moved down may overfill it), down to the last.
Options below the quality floor are never chosen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from sglang_hicache_ext.tuning.placement.utility import ContextProfile, Option, allowed, utility


class Move(NamedTuple):
    key: str
    before: Option
    after: Option
    utility_drop: float


@dataclass(frozen=True)
class Placement:
    chosen: dict[str, Option]
    used_bytes: dict[str, int]
    total_utility: float
    moves: tuple[Move, ...] = field(default=())


def place(
    contexts: Sequence[ContextProfile],
    capacities: Mapping[str, int],
    alpha: float,
    quality_floor: float = 0.0,
) -> Placement:
    """The option of each context; `capacities` in bytes per tier, fastest first."""
    tiers = list(capacities)
    profiles = {c.key: c for c in contexts}
    choices = {c.key: _usable(c, tiers, quality_floor) for c in contexts}

    def value(key: str, option: Option) -> float:
        return utility(option, alpha, profiles[key].frequency)

    chosen = {key: max(options, key=lambda o: value(key, o)) for key, options in choices.items()}
    moves: list[Move] = []
    for rank, tier in enumerate(tiers):
        slower = set(tiers[rank + 1 :])
        while _used(chosen, tier) > capacities[tier]:
            best: Move | None = None
            for key, current in chosen.items():
                if current.tier != tier:
                    continue
                for option in choices[key]:
                    frees = (option.tier == tier and option.nbytes < current.nbytes) or (
                        option.tier in slower or not option.stored
                    )
                    if not frees:
                        continue
                    drop = value(key, current) - value(key, option)
                    if best is None or (drop, -option.nbytes) < (
                        best.utility_drop,
                        -best.after.nbytes,
                    ):
                        best = Move(key, current, option, drop)
            if best is None:  # only without recomputing, when the slowest tier overfills
                raise RuntimeError(f"tier {tier} is over its capacity and no context can leave it")
            chosen[best.key] = best.after
            moves.append(best)
    total = sum(value(key, option) for key, option in chosen.items())
    used = {tier: _used(chosen, tier) for tier in tiers}
    return Placement(chosen, used, total, tuple(moves))


def _usable(context: ContextProfile, tiers: list[str], quality_floor: float) -> list[Option]:
    options = [
        o for o in allowed(context.options, quality_floor) if o.tier is None or o.tier in tiers
    ]
    if not options:
        raise ValueError(f"{context.key}: no option on the tiers {tiers}")
    return options


def _used(chosen: Mapping[str, Option], tier: str) -> int:
    return sum(option.nbytes for option in chosen.values() if option.tier == tier)
