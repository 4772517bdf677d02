"""Disk hit ratio against the disk budget, per TTL policy, on one trace: the online policies
replayed at each budget (same trace, same replay model).

Policies: `fixed` (one TTL per period, solved for the budget), `group` (Algorithm 2's group TTLs
every period, unguarded) and `group+fallback` (group TTLs only while their shadow disk clearly
out-earns one TTL's, `ShadowGuardPlanner`; the live default, `ttl_policy: "group"`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from sglang_hicache_ext.tuning.trace import TraceRequest
from sglang_hicache_ext.tuning.ttl.planner import FixedTtlPlanner, GroupTtlPlanner, TtlPlanner
from sglang_hicache_ext.tuning.ttl.replay import ReplayConfig, replay
from sglang_hicache_ext.tuning.ttl.shadow_guard import ShadowGuardPlanner

POLICIES = ("fixed", "group", "group+fallback")
GB = 1e9
CAPACITY_FACTOR = 2.0  # the live disk tier's default: capacity = 2 x the TTL budget


def planner_named(
    name: str, groups: int, max_ttl_s: float, capacity_factor: float = CAPACITY_FACTOR
) -> TtlPlanner:
    if name == "fixed":
        return FixedTtlPlanner(max_ttl_s)
    if name == "group":
        return GroupTtlPlanner(groups, max_ttl_s, validation_fraction=0.0, shrink_events=0.0)
    if name == "group+fallback":
        return ShadowGuardPlanner(
            [FixedTtlPlanner(max_ttl_s), planner_named("group", groups, max_ttl_s)],
            capacity_factor=capacity_factor,
        )
    raise ValueError(f"unknown TTL policy {name!r}; choose from {', '.join(POLICIES)}")


def sweep(
    requests: Sequence[TraceRequest],
    budgets_gb: Sequence[float],
    config: ReplayConfig,
    policies: Sequence[str] = POLICIES,
    groups: int = 32,
    capacity_factor: float = CAPACITY_FACTOR,
) -> list[dict[str, Any]]:
    """One row per budget: each policy's replay summary (hit ratios, bytes, periods), with the
    disk's hard capacity `capacity_factor` times the budget (inf: uncapped)."""
    rows = []
    for budget in budgets_gb:
        at_budget = replace(
            config,
            disk_budget_bytes=budget * GB,
            disk_capacity_bytes=capacity_factor * budget * GB,
        )
        row: dict[str, Any] = {"budget_gb": budget}
        for name in policies:
            began = time.perf_counter()
            planner = planner_named(name, groups, config.max_ttl_s, capacity_factor)
            result = replay(requests, planner, at_budget)
            summary = result.to_json()
            choices = [period["choice"] for period in summary.pop("ttls")]
            summary["periods"] = len(choices)
            summary["periods_with_group_ttls"] = choices.count("group")
            summary["replay_s"] = time.perf_counter() - began
            row[name] = summary
        if "fixed" in row:
            fixed = row["fixed"]["hit_ratio"]["disk"]
            row["disk_hits_vs_fixed"] = {
                name: (row[name]["hit_ratio"]["disk"] / fixed if fixed else None)
                for name in policies
                if name != "fixed"
            }
        rows.append(row)
    return rows
