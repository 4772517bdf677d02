"""Group TTLs only while they earn more than one TTL would, measured on shadow disks.

Checking a group plan on held-back history (`GroupTtlPlanner`'s validation) judges it with the
same reuse-interval model that fitted it, and on new traffic that model misses what decides the
real hit ratio: a plan that overspends hits the disk's capacity and loses pages early, one that
underspends leaves hits unearned, and a burst in the held-back part misleads the check. The
shadow guard instead runs every candidate planner on a simulated disk of its own (same TTL
semantics, same hard capacity as the real one), fed the real accesses as they arrive, and
publishes a challenger's plan only while its shadow has earned clearly more hits than the
baseline's (one TTL for everything).

"Clearly" is a paired test over periods: both shadows see the same accesses, so the per-period
difference of their hits is the evidence, and periods (not accesses, which come in correlated
bursts) are its unit. Per-period differences swing by far more than a 1-2 % average gain, so a
plain "who leads" rule flips on noise, and every flip costs: pages refreshed under the other plan
get the other plan's TTLs.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from sglang_hicache_ext.radix.access_recorder import AccessRecorder
from sglang_hicache_ext.tiers.pages.ttl_policy import TtlPolicy
from sglang_hicache_ext.tuning.ttl.planner import PlannedTtls, TtlPlanner
from sglang_hicache_ext.tuning.ttl.simulated_disk import SimulatedDisk

Requests = Sequence[tuple[float, tuple[str, ...]]]


class ShadowScore(NamedTuple):
    """What one candidate's shadow disk has earned since the guard started."""

    name: str
    hits: int
    accesses: int
    lead: float  # recent mean of (its hits - baseline hits) per period, over its standard error
    groups: int  # subtree groups in its current plan (0: one TTL, or no plan yet)


class _Shadow:
    """One candidate planner, its current plan and the simulated disk that plan governs."""

    def __init__(self, planner: TtlPlanner, capacity_pages: float) -> None:
        self.planner = planner
        self.disk = SimulatedDisk(capacity_pages)
        self.planned: PlannedTtls | None = None
        self.hits = 0
        self._size_after_forget = 0

    def forget_expired(self, now: float) -> None:
        """Drop expired pages once the disk's memory has doubled since the last time (amortised
        O(1) per access; a pass every period would copy every live page every period)."""
        if len(self.disk) > 2 * max(self._size_after_forget, 4096):
            self.disk.forget_expired(now)
            self._size_after_forget = len(self.disk)

    def feed(self, requests: Requests) -> int:
        """Run `requests` through this candidate's current plan; the hits they earned."""
        if self.planned is None:
            return 0
        policy = TtlPolicy(self.planned.table)
        grouping = self.planned.grouping
        hits = 0
        for now, pages in requests:
            for page, group in zip(pages, grouping.groups_of_path(pages), strict=True):
                hits += self.disk.access(page, policy.expiry_on_access(group, now), now)
        self.hits += hits
        return hits


class ShadowGuardPlanner(TtlPlanner):
    """Publishes a challenger's plan only while its shadow disk clearly out-earns the baseline's.

    `candidates[0]` is the baseline (one TTL for everything). A challenger takes over when, over
    the past periods weighted by 2^(-age / half_life_s), its shadow's mean per-period hit lead
    over the baseline's exceeds both `z` standard errors and `margin` of the baseline's mean
    hits; it keeps the place while the lead stays positive. `capacity_factor` sizes each shadow
    disk's hard capacity from the budget, as the live disk tier sizes its own
    (`DiskTierSettings`: twice the budget).

    With `backtest_period_s`, the first plan call does not start from no evidence: the window it
    is given (e.g. a history restored after a restart) is replayed through every candidate,
    re-planned every `backtest_period_s` from the part of the window before.
    """

    def __init__(
        self,
        candidates: Sequence[TtlPlanner],
        capacity_factor: float = 2.0,
        half_life_s: float = 1800.0,
        z: float = 1.5,
        margin: float = 0.01,
        backtest_period_s: float | None = None,
        name: str = "group+fallback",
    ) -> None:
        if len(candidates) < 2:
            raise ValueError("a shadow guard needs a baseline and at least one other candidate")
        if not capacity_factor >= 1.0:
            raise ValueError(f"capacity_factor must be >= 1, got {capacity_factor}")
        if not (half_life_s > 0 and z >= 0 and margin >= 0):
            raise ValueError("half_life_s must be > 0, z and margin >= 0")
        if backtest_period_s is not None and not backtest_period_s > 0:
            raise ValueError(f"backtest_period_s must be > 0, got {backtest_period_s}")
        self.name = name
        self.capacity_factor = capacity_factor
        self.half_life_s = half_life_s
        self.z = z
        self.margin = margin
        self.backtest_period_s = backtest_period_s
        self._candidates = list(candidates)
        self._shadows: list[_Shadow] = []
        self._fed_until_s = -math.inf
        self._accesses = 0
        self._period_ends: list[float] = []
        self._period_hits: list[list[int]] = []  # per period, each shadow's hits
        self._leader = 0
        self._lock = threading.Lock()  # a live server may re-plan on request and on schedule

    def plan(
        self, recorder: AccessRecorder, start_s: float, end_s: float, budget_pages: float
    ) -> PlannedTtls:
        with self._lock:
            return self._plan(recorder, start_s, end_s, budget_pages)

    def _plan(
        self, recorder: AccessRecorder, start_s: float, end_s: float, budget_pages: float
    ) -> PlannedTtls:
        if not self._shadows:
            capacity = self.capacity_factor * budget_pages
            self._shadows = [_Shadow(planner, capacity) for planner in self._candidates]
            self._backtest(recorder, start_s, end_s, budget_pages)
        elif end_s > self._fed_until_s:  # (a re-plan at the same time has nothing new to feed)
            self._feed(_since(recorder.requests(), self._fed_until_s, end_s), end_s)
        self._fed_until_s = max(self._fed_until_s, end_s)
        self._leader = self._choose(end_s)
        for shadow in self._shadows:
            shadow.planned = shadow.planner.plan(recorder, start_s, end_s, budget_pages)
        chosen = self._shadows[self._leader].planned
        assert chosen is not None
        if self._leader == 0:
            return chosen._replace(choice=f"{chosen.choice} (shadow)")
        return chosen

    def scores(self, now_s: float | None = None) -> list[ShadowScore]:
        """Every candidate's shadow so far (empty before the first plan)."""
        now = self._fed_until_s if now_s is None else now_s
        return [
            ShadowScore(
                s.planner.name,
                s.hits,
                self._accesses,
                self._lead(i, now)[0],
                len(s.planned.grouping.top_subtrees) if s.planned is not None else 0,
            )
            for i, s in enumerate(self._shadows)
        ]

    def _backtest(
        self, recorder: AccessRecorder, start_s: float, end_s: float, budget_pages: float
    ) -> None:
        if self.backtest_period_s is None:
            return
        requests = recorder.requests()
        boundary = start_s + self.backtest_period_s
        while boundary < end_s:
            for shadow in self._shadows:
                shadow.planned = shadow.planner.plan(recorder, start_s, boundary, budget_pages)
            period_end = min(boundary + self.backtest_period_s, end_s)
            self._feed(_since(requests, boundary, period_end), period_end)
            boundary = period_end

    def _feed(self, requests: Requests, end_s: float) -> None:
        self._accesses += sum(len(pages) for _, pages in requests)
        self._period_ends.append(end_s)
        self._period_hits.append([shadow.feed(requests) for shadow in self._shadows])
        for shadow in self._shadows:
            shadow.forget_expired(end_s)
        # Periods older than 30 half-lives weigh < 1e-9: forget them (bounded memory).
        keep = bisect.bisect_left(self._period_ends, end_s - 30 * self.half_life_s)
        del self._period_ends[:keep], self._period_hits[:keep]

    def _lead(self, challenger: int, now_s: float) -> tuple[float, float]:
        """(mean lead / its standard error, mean lead / mean baseline hits), decayed by age."""
        if not self._period_hits or challenger == 0:
            return 0.0, 0.0
        hits = np.asarray(self._period_hits, dtype=float)
        weights = 2.0 ** (-(now_s - np.asarray(self._period_ends)) / self.half_life_s)
        lead = hits[:, challenger] - hits[:, 0]
        mean = float(np.average(lead, weights=weights))
        baseline = float(np.average(hits[:, 0], weights=weights))
        spread = float(np.average((lead - mean) ** 2, weights=weights))
        effective_periods = weights.sum() ** 2 / (weights**2).sum()
        if effective_periods < 2 or spread == 0.0:
            return 0.0, 0.0  # one period (or identical plans) is no evidence either way
        standard_error = math.sqrt(spread / (effective_periods - 1))
        return mean / standard_error, mean / baseline if baseline > 0 else math.inf

    def _choose(self, now_s: float) -> int:
        leads = [self._lead(i, now_s) for i in range(len(self._shadows))]
        if self._leader != 0 and leads[self._leader][0] > 0:
            return self._leader
        best = max(range(len(leads)), key=lambda i: leads[i][0])
        t_stat, relative = leads[best]
        return best if t_stat > self.z and relative > self.margin else 0


def _since(requests: Requests, start_s: float, end_s: float) -> Requests:
    times = [time for time, _ in requests]
    return requests[bisect.bisect_left(times, start_s) : bisect.bisect_left(times, end_s)]
