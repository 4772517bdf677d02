"""Online TTLs for a live server: recording, per-tier hit ratios, planning each period."""

from __future__ import annotations

import time

import pytest

from sglang_hicache_ext.radix.groups import RESIDUAL_GROUP, SHARED_PREFIX_GROUP
from sglang_hicache_ext.tuning.ttl.online import OnlineTtl, OnlineTtlConfig


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _path(doc: str, pages: int = 4) -> list[str]:
    return ["sys0", "sys1", *(f"{doc}{i}" for i in range(pages))]


def _planted(online: OnlineTtl, clock: FakeClock, steps: int = 40) -> None:
    """Two hot documents behind a shared prefix, one cold one-off per step (10 s)."""
    for step in range(steps):
        clock.now = step * 10.0
        online.record(_path("hot-a" if step % 2 else "hot-b"))
        online.record(_path(f"cold{step}"))


def test_record_counts_tiers_per_group() -> None:
    clock = FakeClock()
    online = OnlineTtl(OnlineTtlConfig(policy="static", initial_ttl_s=60.0), clock=clock)
    groups = online.record(_path("doc"), device_pages=2, host_pages=1)
    assert groups == [RESIDUAL_GROUP] * 6  # no plan yet: one group for everything
    online.record_disk_hits([RESIDUAL_GROUP] * 3)
    status = online.status()
    assert status["page_accesses"] == {RESIDUAL_GROUP: 6}
    assert status["hit_ratio"] == pytest.approx({"device": 2 / 6, "host": 1 / 6, "disk": 3 / 6})
    assert status["ttls"] == {"default": 60.0}


def test_replan_finds_the_planted_groups_within_budget() -> None:
    clock = FakeClock()
    online = OnlineTtl(
        # Tight: one TTL cannot keep the hot documents (reused every 20 s) for this average.
        OnlineTtlConfig(
            policy="group-always", top_k=2, disk_budget_bytes=14 * 1000.0, window_s=1e6
        ),
        clock=clock,
    )
    assert online.replan() is None  # nothing recorded, page size unknown
    _planted(online, clock)
    online.set_page_bytes(1000)
    plan = online.replan()
    assert plan is not None and plan.groups == 2 and plan.choice == "group", plan
    groups = online.groups_of(_path("hot-a"))
    assert groups[:2] == [SHARED_PREFIX_GROUP] * 2
    assert groups[2:] == ["subtree:hot-a0"] * 4
    assert online.groups_of(_path("new"))[2:] == [RESIDUAL_GROUP] * 4
    # Hot subtrees are reused every 20 s: they get at least that TTL; one-offs never return.
    assert online.ttl_of("subtree:hot-a0") >= 20.0
    assert online.ttl_of(RESIDUAL_GROUP) < online.ttl_of("subtree:hot-a0")


@pytest.mark.parametrize(
    ("hot_documents", "expected"),
    # Two hot documents among one-offs: group TTLs keep them, one TTL cannot (budget too
    # tight) -> the shadow of the group plan out-earns the single TTL's. Only one-offs: no
    # group differs, the guard keeps the single TTL.
    [(True, "group"), (False, "fixed (shadow)")],
)
def test_default_group_policy_publishes_groups_only_when_their_shadow_out_earns(
    hot_documents: bool, expected: str
) -> None:
    clock = FakeClock()
    config = OnlineTtlConfig(
        policy="group", top_k=2, disk_budget_bytes=14 * 1000.0, period_s=100.0, window_s=1e6
    )
    online = OnlineTtl(config, clock=clock)
    if hot_documents:
        _planted(online, clock, steps=120)
    else:
        for step in range(120):
            clock.now = step * 10.0
            online.record(_path(f"cold{step}"))
            online.record(_path(f"other{step}"))
    online.set_page_bytes(1000)
    plan = online.replan()  # the first plan backtests both candidates on the 1,190 s window
    assert plan is not None and plan.choice == expected, plan
    assert (plan.groups == 2) == hot_documents


def test_first_period_ttl_is_paced_from_the_budget_until_the_first_plan() -> None:
    clock = FakeClock()
    config = OnlineTtlConfig(policy="group", disk_budget_bytes=10 * 1000.0, initial_ttl_s=600.0)
    online = OnlineTtl(config, clock=clock)
    online.record(_path("a"))  # page size unknown yet: the configured initial TTL
    assert online.ttl_of(RESIDUAL_GROUP) == 600.0
    online.set_page_bytes(1000)  # budget: 10 pages on average
    clock.now = 10.0
    online.record(_path("b"))
    # Little's law: 12 page writes in 10 s keep 10 pages on average for 10 * 10 / 12 s.
    assert online.ttl_of(RESIDUAL_GROUP) == pytest.approx(10 * 10 / 12)
    clock.now = 30.0
    online.record(_path("c"))
    assert online.ttl_of(RESIDUAL_GROUP) == pytest.approx(10 * 30 / 18)
    plan = online.replan()
    assert plan is not None
    clock.now = 40.0
    online.record(_path("d"))  # planned from now on: pacing stops
    assert online.ttl_of(RESIDUAL_GROUP) == plan.ttls["default"]


def test_pacing_can_be_turned_off() -> None:
    clock = FakeClock()
    config = OnlineTtlConfig(disk_budget_bytes=10 * 1000.0, pace_first_period=False)
    online = OnlineTtl(config, clock=clock)
    online.set_page_bytes(1000)
    clock.now = 10.0
    online.record(_path("a"))
    assert online.ttl_of(RESIDUAL_GROUP) == config.initial_ttl_s


def test_fixed_policy_publishes_one_ttl() -> None:
    clock = FakeClock()
    online = OnlineTtl(
        OnlineTtlConfig(policy="fixed", disk_budget_bytes=40 * 1000.0, window_s=1e6), clock=clock
    )
    _planted(online, clock)
    online.set_page_bytes(1000)
    plan = online.replan()
    assert plan is not None and plan.choice == "fixed"
    assert list(plan.ttls) == ["default"]


def test_background_planning_each_period() -> None:
    online = OnlineTtl(OnlineTtlConfig(policy="fixed", period_s=0.2, window_s=60.0))
    online.set_page_bytes(1000)
    for doc in ("a", "b", "a", "b"):
        online.record(_path(doc))
    online.start()
    try:
        deadline = time.monotonic() + 10.0
        while online.status()["plans"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        online.stop()
    status = online.status()
    assert status["plans"] >= 2, status
    assert status["plan_error"] is None


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("policy", "lru", "not one of"),
        ("period_s", 0.0, "period_s"),
        ("disk_budget_bytes", -1.0, "disk_budget_bytes"),
        ("top_k", -1, "top_k"),
    ],
)
def test_bad_config_is_rejected(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OnlineTtlConfig(**{field: value})  # type: ignore[arg-type]
