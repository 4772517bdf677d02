"""Online TTLs for a live server: record accesses, re-plan every period, publish to the policy.

The live counterpart of `sglang_hicache_ext.tuning.ttl.replay --online`: each period's TTLs come only from the
accesses of a sliding window before it (same planners, same `TtlPolicy`). Planning runs in a
daemon thread on a snapshot of the window, so recording (called from the scheduler) never waits
for the optimiser. `history()` / `restore()` carry the window, the page size and the last plan
across a restart (`sglang_hicache_ext.tuning.ttl.history_file` puts them on disk).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from sglang_hicache_ext.radix.access_recorder import AccessRecorder
from sglang_hicache_ext.radix.groups import RESIDUAL_GROUP, SubtreeGrouping
from sglang_hicache_ext.tiers.pages.ttl_policy import TtlPolicy, TtlTable
from sglang_hicache_ext.tuning.ttl.budget import average_pages, paced_ttl
from sglang_hicache_ext.tuning.ttl.history_file import SavedPlan, TtlHistory
from sglang_hicache_ext.tuning.ttl.online_config import OnlineTtlConfig
from sglang_hicache_ext.tuning.ttl.planner import PlannedTtls
from sglang_hicache_ext.tuning.ttl.shadow_guard import ShadowGuardPlanner

logger = logging.getLogger(__name__)

TIERS = ("device", "host", "disk")


class RestoredHistory(NamedTuple):
    """What `OnlineTtl.restore` took from a saved history."""

    requests: int
    page_accesses: int
    plan_restored: bool  # the saved plan's TTLs and grouping are in force until the next plan


class PlanRecord(NamedTuple):
    at_s: float
    window: tuple[float, float]
    choice: str
    ttls: dict[str, float]
    groups: int
    seconds: float  # time the planner took


class OnlineTtl:
    """Access log + current grouping and TTLs of one storage tier; thread-safe."""

    def __init__(
        self,
        config: OnlineTtlConfig,
        policy: TtlPolicy | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.policy = policy if policy is not None else TtlPolicy(config.initial_table())
        self._planner = config.planner()
        self._clock = clock
        self._lock = threading.Lock()
        self._recorder = AccessRecorder()
        self._grouping = SubtreeGrouping()
        self._bytes_per_page = 0
        self._page_bytes_measured = False  # a restored size gives way to the first measured one
        started_s = clock()
        self._window_start_s = started_s  # plans never look back before this (moved by restore)
        self._next_plan_s = started_s + config.period_s
        self._plans: list[PlanRecord] = []
        self._last_plan: SavedPlan | None = None
        self._restored_plan_at_s: float | None = None
        self._changes = 0  # requests recorded + plans made: tells a saver whether to save again
        self._record_errors = 0
        self._hits: dict[tuple[str, str], int] = defaultdict(int)  # (tier, group) -> pages
        self._accesses: dict[str, int] = defaultdict(int)  # group -> pages
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._plan_error: str | None = None
        self._last_time = -math.inf

    # -- recording (scheduler thread) -------------------------------------------------------

    def record(self, pages: Sequence[str], device_pages: int = 0, host_pages: int = 0) -> list[str]:
        """One request's page path; the first `device_pages` hit the device, the next
        `host_pages` the host. Returns the group of every page.

        Called from the scheduler thread: an unexpected error is logged and counted, and the
        pages are then treated as residual (never an exception into SGLang)."""
        try:
            return self._record(pages, device_pages, host_pages)
        except Exception:
            with self._lock:
                self._record_errors += 1
                first = self._record_errors == 1
            if first:
                logger.exception("hicache_ext: recording an access failed (pages: residual)")
            else:
                logger.error(
                    "hicache_ext: recording an access failed (%d so far)", self._record_errors
                )
            return [RESIDUAL_GROUP] * len(pages)

    def _record(self, pages: Sequence[str], device_pages: int, host_pages: int) -> list[str]:
        now = self._clock()
        with self._lock:
            # Requests reach the scheduler in arrival order, but clocks can step back.
            if len(self._recorder) and now < self._last_time:
                now = self._last_time
            self._last_time = now
            self._recorder.record_request(now, pages)
            self._changes += 1
            if self._pacing():
                budget_pages = average_pages(self.config.disk_budget_bytes, self._bytes_per_page)
                elapsed = now - self._window_start_s
                writes = self._recorder.page_accesses
                self.policy.update(
                    TtlTable(paced_ttl(budget_pages, writes, elapsed, self.config.max_ttl_s))
                )
            groups = self._grouping.groups_of_path(pages)
            for index, group in enumerate(groups):
                self._accesses[group] += 1
                if index < device_pages:
                    self._hits["device", group] += 1
                elif index < device_pages + host_pages:
                    self._hits["host", group] += 1
        return groups

    def _pacing(self) -> bool:
        """Whether the TTL is still paced: no plan made or restored yet, page size known."""
        return (
            self.config.pace_first_period
            and self.config.policy != "static"
            and self._last_plan is None
            and self._bytes_per_page > 0
        )

    def record_disk_hits(self, groups: Sequence[str]) -> None:
        with self._lock:
            for group in groups:
                self._hits["disk", group] += 1

    def groups_of(self, pages: Sequence[str]) -> list[str]:
        with self._lock:
            return self._grouping.groups_of_path(pages)

    def ttl_of(self, group: str) -> float:
        return self.policy.ttl(group)

    def set_page_bytes(self, size: int) -> None:
        """Bytes of one stored page (known once the first page is written)."""
        with self._lock:
            if self._page_bytes_measured:
                self._bytes_per_page = max(self._bytes_per_page, int(size))
            else:  # replaces a size restored from before a restart (the model may differ)
                self._bytes_per_page, self._page_bytes_measured = int(size), True

    # -- planning --------------------------------------------------------------------------

    def start(self) -> None:
        """Re-plan every period in a daemon thread (no-op for the static policy)."""
        if self.config.policy == "static" or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="hicache-ext-ttl", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop planning; waits up to `timeout_s` for a plan in progress."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def replan(self, now: float | None = None) -> PlanRecord | None:
        """Plan the next period from the window before `now` and publish it.

        None when there is nothing to plan from yet (no access, or page size unknown).
        """
        now = self._clock() if now is None else now
        start = max(self._window_start_s, now - self.config.window_s)
        with self._lock:
            self._recorder.forget_before(start)
            if not len(self._recorder) or self._bytes_per_page == 0:
                return None
            snapshot = AccessRecorder()
            for time_s, path in self._recorder.requests():
                snapshot.record_request(time_s, path)
            budget_pages = average_pages(self.config.disk_budget_bytes, self._bytes_per_page)
        began = time.perf_counter()
        planned: PlannedTtls = self._planner.plan(snapshot, start, now, budget_pages)
        record = PlanRecord(
            now,
            (start, now),
            planned.choice,
            planned.table.as_dict(),
            len(planned.grouping.top_subtrees),
            time.perf_counter() - began,
        )
        with self._lock:
            self.policy.update(planned.table)
            self._grouping = planned.grouping
            self._plans.append(record)
            self._last_plan = SavedPlan(now, planned.table, planned.grouping)
            self._changes += 1
        logger.info(
            "hicache_ext TTLs for the next %.0f s (%s, %d subtree groups, planned in %.2f s): %s;"
            " hit ratio so far per tier: %s",
            self.config.period_s,
            record.choice,
            record.groups,
            record.seconds,
            {name: round(ttl, 1) for name, ttl in record.ttls.items()},
            {tier: round(r, 3) for tier, r in self.status()["hit_ratio"].items()},
        )
        return record

    def _run(self) -> None:
        while not self._stop.wait(max(0.0, self._next_plan_s - self._clock())):
            self._next_plan_s += self.config.period_s
            try:
                self.replan()
                self._plan_error = None
            except Exception as error:  # keep the last published TTLs; report why
                self._plan_error = f"{type(error).__name__}: {error}"
                logger.exception("hicache_ext TTL planning failed; keeping the current TTLs")

    # -- restart -----------------------------------------------------------------------------

    @property
    def changes(self) -> int:
        """Grows with every recorded request and plan (a saver saves only when it moved)."""
        with self._lock:
            return self._changes

    def history(self) -> TtlHistory:
        """What a restarted server needs to plan as if it had not stopped: the requests of the
        window (older ones are forgotten now), the page size, the last plan."""
        now = self._clock()
        with self._lock:
            start = max(self._window_start_s, now - self.config.window_s)
            self._recorder.forget_before(start)
            return TtlHistory(
                saved_at_s=now,
                policy=self.config.policy,
                window_start_s=start,
                bytes_per_page=self._bytes_per_page,
                requests=tuple(self._recorder.requests()),
                plan=self._last_plan,
            )

    def restore(self, history: TtlHistory) -> RestoredHistory:
        """Take over a saved history; call before the first `record`.

        Requests older than this config's window are dropped. The saved plan is put back in
        force (until the next plan, TTLs capped at `max_ttl_s`) only when it was made by the same
        policy, is not `static` (its table is the config's), and lies within the window: an
        older plan reflects accesses the next plan will not see either.
        """
        now = self._clock()
        start = max(history.window_start_s, now - self.config.window_s)
        kept = [(time_s, path) for time_s, path in history.requests if time_s >= start]
        plan = history.plan
        plan_usable = (
            plan is not None
            and history.policy == self.config.policy
            and self.config.policy != "static"
            and now - plan.at_s <= self.config.window_s
        )
        with self._lock:
            if len(self._recorder):
                raise ValueError("restore() must come before the first recorded request")
            for time_s, path in kept:
                self._recorder.record_request(time_s, path)
            if kept:
                self._last_time = kept[-1][0]
                self._window_start_s = min(self._window_start_s, start)
            if history.bytes_per_page and not self._page_bytes_measured:
                self._bytes_per_page = history.bytes_per_page
            if plan is not None and plan_usable:
                cap = self.config.max_ttl_s
                table = TtlTable(
                    min(plan.table.default_ttl, cap),
                    {group: min(ttl, cap) for group, ttl in plan.table.ttls.items()},
                )
                self.policy.update(table)
                self._grouping = plan.grouping
                self._last_plan = SavedPlan(plan.at_s, table, plan.grouping)
                self._restored_plan_at_s = plan.at_s
            page_accesses = self._recorder.page_accesses
        return RestoredHistory(len(kept), page_accesses, plan_usable)

    # -- reporting -------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        with self._lock:
            groups = sorted(self._accesses)
            hit_ratio = {
                tier: {
                    group: self._hits[tier, group] / self._accesses[group]
                    for group in groups
                    if self._accesses[group]
                }
                for tier in TIERS
            }
            total = sum(self._accesses.values())
            overall = {
                tier: (sum(self._hits[tier, g] for g in groups) / total if total else 0.0)
                for tier in TIERS
            }
            last = self._plans[-1] if self._plans else None
            return {
                "policy": self.config.policy,
                "period_s": self.config.period_s,
                "window_s": self.config.window_s,
                "disk_budget_bytes": self.config.disk_budget_bytes,
                "bytes_per_page": self._bytes_per_page,
                "ttls": self.policy.table.as_dict(),
                "plans": len(self._plans),
                "last_plan": last._asdict() if last else None,
                "plan_error": self._plan_error,
                "next_plan_in_s": None
                if self.config.policy == "static"
                else max(0.0, self._next_plan_s - self._clock()),
                "page_accesses": dict(self._accesses),
                "window_requests": len(self._recorder),
                "window_page_accesses": self._recorder.page_accesses,
                "restored_plan_at_s": self._restored_plan_at_s,
                "record_errors": self._record_errors,
                # The guard's evidence: each candidate's simulated-disk hits and its lead over
                # one TTL (in standard errors; it takes over above the guard's z).
                "shadows": [score._asdict() for score in self._planner.scores()]
                if isinstance(self._planner, ShadowGuardPlanner)
                else None,
                "hit_ratio": overall,
                "hit_ratio_by_group": hit_ratio,
            }
