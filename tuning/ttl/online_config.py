"""How a live server chooses TTLs: the policy, the budget, the planning period and window."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

from sglang_hicache_ext.tiers.pages.ttl_policy import TtlTable

if TYPE_CHECKING:
    from sglang_hicache_ext.tuning.ttl.planner import TtlPlanner

# The disk tier's setting `ttl_policy` takes this type (sglang_ext/config/disk_tier_settings.py).
OnlineTtlPolicy = Literal["group", "group-always", "fixed", "static"]
POLICIES: tuple[str, ...] = get_args(OnlineTtlPolicy)


@dataclass(frozen=True)
class OnlineTtlConfig:
    """How TTLs are chosen on a live server (units: seconds and bytes)."""

    # group: group TTLs while their shadow disk out-earns one TTL's, else one TTL (the default);
    # group-always: group TTLs every period; fixed: one TTL; static: initial_ttl_s / static_ttls
    policy: str = "group"
    disk_budget_bytes: float = 8 * 2**30  # average bytes on disk the TTLs may cost
    capacity_bytes: float | None = None  # the disk's hard capacity; None: twice the budget
    period_s: float = 300.0
    window_s: float = 3600.0
    top_k: int = 8
    max_ttl_s: float = 86_400.0
    initial_ttl_s: float = 600.0  # before any page size is known (and the default of `static`)
    # Until the first plan, pace the TTL from the budget and the page write rate seen so far
    # (Little's law, as the replay's first period) instead of keeping initial_ttl_s.
    pace_first_period: bool = True
    static_ttls: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"ttl policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        for name in ("disk_budget_bytes", "initial_ttl_s", "max_ttl_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
        for name in ("period_s", "window_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.capacity_bytes is not None and not (
            math.isfinite(self.capacity_bytes) and self.capacity_bytes > 0
        ):
            raise ValueError(f"capacity_bytes must be > 0, got {self.capacity_bytes!r}")

    def initial_table(self) -> TtlTable:
        return TtlTable(self.initial_ttl_s, dict(self.static_ttls))

    def planner(self) -> TtlPlanner:
        # Imported here: the planners import scipy; the settings model reads only the policy names.
        from sglang_hicache_ext.tuning.ttl.planner import FixedTtlPlanner, GroupTtlPlanner
        from sglang_hicache_ext.tuning.ttl.shadow_guard import ShadowGuardPlanner

        if self.policy in ("group", "group-always"):
            group = GroupTtlPlanner(
                self.top_k, self.max_ttl_s, validation_fraction=0.0, shrink_events=0.0
            )
            if self.policy == "group-always":
                return group
            capacity_factor = (
                2.0
                if self.capacity_bytes is None or self.disk_budget_bytes <= 0
                else max(1.0, self.capacity_bytes / self.disk_budget_bytes)
            )
            return ShadowGuardPlanner(
                [FixedTtlPlanner(self.max_ttl_s), group],
                capacity_factor=capacity_factor,
                backtest_period_s=self.period_s,
            )
        if self.policy == "fixed":
            return FixedTtlPlanner(self.max_ttl_s)
        return FixedTtlPlanner(self.max_ttl_s, table=self.initial_table())
