"""Cloud cost model: GPU-hours, host DRAM and disk volumes priced per GB-hour.

Disk types follow the shape of cloud enterprise-SSD tables (Alibaba Cloud ESSD PL0-PL3): each
level has a minimum billable size, a per-GB monthly price and a throughput that grows linearly with
the provisioned capacity up to a cap. `essd_auto` picks the level from the capacity, as operators
do, which is where the price cliffs are: crossing 461 GB (PL2's minimum) or 1261 GB (PL3's) buys a
faster level whose every GB costs more, so the bill jumps while capacity grows by one GB.
Prices are list prices of the right order of magnitude, not a quote; override them per study.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

GB = 1e9
HOURS_PER_MONTH = 730.0


@dataclass(frozen=True)
class DiskLevel:
    """One provisioned SSD level: billing and capacity-coupled throughput."""

    name: str
    min_gb: float
    max_gb: float
    usd_per_gb_month: float
    base_mb_s: float
    mb_s_per_gb: float
    max_mb_s: float

    def billable_gb(self, capacity_gb: float) -> float:
        return max(capacity_gb, self.min_gb)

    def bandwidth_bytes_s(self, capacity_gb: float) -> float:
        mb_s = min(self.max_mb_s, self.base_mb_s + self.mb_s_per_gb * self.billable_gb(capacity_gb))
        return mb_s * 1e6

    def usd_per_hour(self, capacity_gb: float) -> float:
        return self.billable_gb(capacity_gb) * self.usd_per_gb_month / HOURS_PER_MONTH


_PL0 = DiskLevel("essd_pl0", 40, 65536, 0.08, 100, 0.25, 180)
_PL1 = DiskLevel("essd_pl1", 20, 65536, 0.15, 120, 0.5, 350)
_PL2 = DiskLevel("essd_pl2", 461, 65536, 0.30, 120, 0.5, 750)
_PL3 = DiskLevel("essd_pl3", 1261, 65536, 0.60, 120, 0.5, 4000)


@dataclass(frozen=True)
class DiskType:
    """A disk choice: one level, or several levels chosen by capacity (first that fits)."""

    name: str
    levels: tuple[DiskLevel, ...]

    def level_for(self, capacity_gb: float) -> DiskLevel:
        if not math.isfinite(capacity_gb) or capacity_gb < 0:
            raise ValueError(f"disk capacity must be finite and >= 0 GB, got {capacity_gb!r}")
        # An auto type moves up a level as soon as the capacity reaches that level's minimum.
        level = self.levels[0]
        for candidate in self.levels[1:]:
            if capacity_gb >= candidate.min_gb:
                level = candidate
        if capacity_gb > level.max_gb:
            raise ValueError(
                f"disk type {self.name!r} offers at most {level.max_gb:g} GB, "
                f"asked for {capacity_gb:g} GB"
            )
        return level

    def bandwidth_bytes_s(self, capacity_gb: float) -> float:
        return self.level_for(capacity_gb).bandwidth_bytes_s(capacity_gb)

    def usd_per_hour(self, capacity_gb: float) -> float:
        return self.level_for(capacity_gb).usd_per_hour(capacity_gb)


DISK_TYPES: MappingProxyType[str, DiskType] = MappingProxyType(
    {
        "essd_pl0": DiskType("essd_pl0", (_PL0,)),
        "essd_pl1": DiskType("essd_pl1", (_PL1,)),
        "essd_pl2": DiskType("essd_pl2", (_PL2,)),
        "essd_pl3": DiskType("essd_pl3", (_PL3,)),
        "essd_auto": DiskType("essd_auto", (_PL1, _PL2, _PL3)),
    }
)


def disk_type(name: str) -> DiskType:
    """The disk type called `name`; a clear error lists the known ones."""
    try:
        return DISK_TYPES[name]
    except KeyError:
        raise ValueError(
            f"unknown disk type {name!r}; known types: {', '.join(sorted(DISK_TYPES))}"
        ) from None


@dataclass(frozen=True)
class Pricing:
    """Hourly prices: one H100-class GPU instance and host DRAM (memory-optimised VM share)."""

    gpu_usd_per_hour: float = 3.0
    dram_usd_per_gb_hour: float = 0.004

    def __post_init__(self) -> None:
        for name in ("gpu_usd_per_hour", "dram_usd_per_gb_hour"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")


@dataclass(frozen=True)
class CostBreakdown:
    gpu_usd: float
    dram_usd: float
    disk_usd: float
    usd_per_hour: float  # provisioned rate: what the configuration costs per hour of service

    @property
    def total_usd(self) -> float:
        return self.gpu_usd + self.dram_usd + self.disk_usd


def deployment_cost(
    pricing: Pricing,
    *,
    instances: int,
    dram_gb_per_instance: float,
    disk: DiskType | None,
    disk_gb: float,
    hours: float,
) -> CostBreakdown:
    """Cost of running the deployment for `hours` (GPU-hours include draining the queue)."""
    if instances < 1:
        raise ValueError(f"instances must be >= 1, got {instances}")
    if dram_gb_per_instance < 0 or disk_gb < 0 or hours < 0:
        raise ValueError("DRAM capacity, disk capacity and hours must be >= 0")
    gpu_rate = pricing.gpu_usd_per_hour * instances
    dram_rate = pricing.dram_usd_per_gb_hour * dram_gb_per_instance * instances
    disk_rate = disk.usd_per_hour(disk_gb) if disk is not None else 0.0
    return CostBreakdown(
        gpu_usd=gpu_rate * hours,
        dram_usd=dram_rate * hours,
        disk_usd=disk_rate * hours,
        usd_per_hour=gpu_rate + dram_rate + disk_rate,
    )
