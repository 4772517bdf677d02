"""TTL planners: turn the recorded accesses of a past window and a budget into a `TtlTable`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import numpy as np

from sglang_hicache_ext.radix.access_recorder import AccessRecorder, WindowStats
from sglang_hicache_ext.radix.groups import RESIDUAL_GROUP, SubtreeGrouping
from sglang_hicache_ext.tiers.pages.ttl_policy import TtlTable
from sglang_hicache_ext.tuning.ttl.budget import page_seconds
from sglang_hicache_ext.tuning.ttl.optimiser import (
    TtlSolution,
    fit_budget,
    solve_fixed_ttl,
    solve_group_ttls,
)
from sglang_hicache_ext.tuning.ttl.profile import GroupProfile, merge_profiles
from sglang_hicache_ext.tuning.ttl.profile_set import ProfileSet


class PlannedTtls(NamedTuple):
    table: TtlTable
    grouping: SubtreeGrouping  # how pages map to the table's groups
    choice: str  # which solution was published ("fixed", "group", "fixed (validation)")


class TtlPlanner(ABC):
    """Chooses TTLs for the next period from the accesses of a past window."""

    name: str

    @abstractmethod
    def plan(
        self, recorder: AccessRecorder, start_s: float, end_s: float, budget_pages: float
    ) -> PlannedTtls:
        """TTLs whose cost on [start_s, end_s) averages at most `budget_pages` pages on disk."""


def profiles_of(stats: WindowStats) -> list[GroupProfile]:
    return [
        GroupProfile.build(name, reuse.intervals, reuse.unique_pages)
        for name, reuse in stats.reuse.items()
    ]


class FixedTtlPlanner(TtlPlanner):
    """One TTL for every page (the baseline), solved exactly for each window's budget.

    Given `table`, publishes that table for every window instead, whatever the accesses (policy
    "static", e.g. a TTL chosen in hindsight or configured TTLs); `max_ttl_s` is then unused.
    """

    def __init__(self, max_ttl_s: float, table: TtlTable | None = None) -> None:
        self.max_ttl_s = max_ttl_s
        self.table = table
        self.name = "fixed" if table is None else "static"

    def plan(
        self, recorder: AccessRecorder, start_s: float, end_s: float, budget_pages: float
    ) -> PlannedTtls:
        if self.table is not None:
            return PlannedTtls(self.table, SubtreeGrouping(), "static")
        stats = recorder.window_stats(0, start_s, end_s)
        budget = page_seconds(budget_pages, end_s - start_s)
        solution = solve_fixed_ttl(profiles_of(stats), budget, self.max_ttl_s)
        return PlannedTtls(_fixed_table(solution, self.max_ttl_s), stats.grouping, "fixed")


class GroupTtlPlanner(TtlPlanner):
    """A TTL per group (top-K subtrees, shared prefix, residual) from Algorithm 2.

    Subtrees are ranked by reuse in the last `rank_window_s` of the window (default: all of it).

    Validation guard (on by default): group TTLs are also fitted on the older part of the window
    and scored on its newest `validation_fraction` against one TTL at the same held-out cost.
    Unless they win there by `validation_margin` (relative hits), the single TTL fitted on the
    whole window is published instead: per-group TTLs carry more variance than one TTL, and on
    chat-like traces at large budgets their in-sample gain does not carry over to the next
    period.
    """

    name = "group"

    def __init__(
        self,
        top_k: int,
        max_ttl_s: float,
        seed: int = 0,
        validation_fraction: float = 0.5,
        rank_window_s: float = np.inf,
        validation_margin: float = 0.05,
        hull_start: bool = True,
        shrink_events: float = 20.0,
    ) -> None:
        if not 0.0 <= validation_fraction < 1.0:
            raise ValueError("validation_fraction must be in [0, 1)")
        if rank_window_s <= 0:
            raise ValueError("rank_window_s must be > 0")
        self.rank_window_s = rank_window_s
        self.validation_margin = validation_margin
        self.hull_start = hull_start
        self.shrink_events = shrink_events
        self.top_k = top_k
        self.max_ttl_s = max_ttl_s
        self.seed = seed
        self.validation_fraction = validation_fraction

    def plan(
        self, recorder: AccessRecorder, start_s: float, end_s: float, budget_pages: float
    ) -> PlannedTtls:
        stats = recorder.window_stats(
            self.top_k, start_s, end_s, rank_from_s=end_s - self.rank_window_s
        )
        profiles = profiles_of(stats)
        budget = page_seconds(budget_pages, end_s - start_s)
        if self.validation_fraction > 0 and not self._validates(
            recorder, start_s, end_s, budget_pages
        ):
            fixed = solve_fixed_ttl(profiles, budget, self.max_ttl_s)
            table = _fixed_table(fixed, self.max_ttl_s)
            return PlannedTtls(table, stats.grouping, "fixed (validation)")
        ttls = self._shrunk(self._solve(profiles, budget), profiles, budget)
        residual = ttls.pop(RESIDUAL_GROUP, 0.0)
        return PlannedTtls(TtlTable(default_ttl=residual, ttls=ttls), stats.grouping, "group")

    def _solve(self, profiles: list[GroupProfile], budget: float) -> TtlSolution:
        return solve_group_ttls(
            profiles, budget, self.max_ttl_s, self.top_k, self.seed, self.hull_start
        )

    def _validates(
        self, recorder: AccessRecorder, start_s: float, end_s: float, budget_pages: float
    ) -> bool:
        """Whether group TTLs beat one TTL after the split, both fitted before it for the budget.

        Both are scored by the hits each gets on the held-out part at its own cost there, not at
        equal cost: the group plan tends to under-spend on new traffic (the subtrees it paid for
        cool down) while one TTL spends its budget, and an equal-cost check hid exactly that loss.
        """
        split = end_s - (end_s - start_s) * self.validation_fraction
        fit = recorder.window_stats(
            self.top_k, start_s, split, rank_from_s=split - self.rank_window_s
        )
        if fit.accesses == 0:
            return True  # nothing to validate against: trust the group solution
        fit_profiles = profiles_of(fit)
        budget = page_seconds(budget_pages, split - start_s)
        group = self._shrunk(self._solve(fit_profiles, budget), fit_profiles, budget)
        fixed_ttl = merge_profiles(fit_profiles).ttl_for_cost(budget, self.max_ttl_s)
        held_out = profiles_of(recorder.window_stats(0, split, end_s, grouping=fit.grouping))
        held_out_set = ProfileSet(held_out)
        group_hits = int(held_out_set.hits(np.array([group[p.name] for p in held_out])).sum())
        fixed_hits = merge_profiles(held_out).hits(fixed_ttl)
        return group_hits >= (1.0 + self.validation_margin) * fixed_hits

    def _shrunk(
        self, solution: TtlSolution, profiles: list[GroupProfile], budget: float
    ) -> dict[str, float]:
        """Group TTLs where the evidence holds, the single TTL where it is thin.

        A group with fewer than `shrink_events` reuse events in the window takes the single
        TTL instead of one fitted to a handful of intervals; then all are rescaled to the budget.
        (Not a log-time blend: hits are steps at the reuse intervals, and a TTL pulled a little
        below a group's interval loses all of them.)
        """
        if self.shrink_events <= 0 or not profiles:
            return dict(solution.ttls)
        single = merge_profiles(profiles).ttl_for_cost(budget, self.max_ttl_s)
        ttls = np.array(
            [
                solution.ttls[p.name] if p.reuse_events >= self.shrink_events else single
                for p in profiles
            ]
        )
        fitted = fit_budget(ProfileSet(profiles), ttls, budget, self.max_ttl_s)
        return {p.name: float(t) for p, t in zip(profiles, fitted, strict=True)}


def _fixed_table(solution: TtlSolution, max_ttl_s: float) -> TtlTable:
    return TtlTable(default_ttl=next(iter(solution.ttls.values()), max_ttl_s))
