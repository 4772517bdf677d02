"""Configurations searched: host DRAM per instance x disk TTL x disk type."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from sglang_hicache_ext.tuning.cost import disk_type
from sglang_hicache_ext.tuning.sim.config import DiskConfig, SimConfig

NO_DISK = "none"


class Point(NamedTuple):
    """One configuration; TTL 0 means no disk tier, so its disk type is `NO_DISK`."""

    dram_gb: float
    ttl_s: float
    disk: str

    @classmethod
    def make(cls, dram_gb: float, ttl_s: float, disk: str) -> Point:
        if not math.isfinite(dram_gb) or dram_gb < 0:
            raise ValueError(f"DRAM capacity must be finite and >= 0 GB, got {dram_gb!r}")
        if not math.isfinite(ttl_s) or ttl_s < 0:
            raise ValueError(f"TTL must be finite and >= 0 s, got {ttl_s!r}")
        if ttl_s == 0:
            return cls(float(dram_gb), 0.0, NO_DISK)
        disk_type(disk)
        return cls(float(dram_gb), float(ttl_s), disk)

    def sim_config(self, instances: int) -> SimConfig:
        disk = None if self.ttl_s == 0 else DiskConfig(self.disk, "ttl", self.ttl_s)
        return SimConfig(instances=instances, dram_gb=self.dram_gb, disk=disk)


@dataclass(frozen=True)
class Axis:
    """Values lo, lo+step, ..., hi (hi included when on the lattice)."""

    lo: float
    hi: float
    step: float

    def __post_init__(self) -> None:
        if self.lo < 0 or self.hi < self.lo or self.step <= 0:
            raise ValueError(
                f"bad axis: need 0 <= lo <= hi and step > 0, got lo={self.lo} hi={self.hi} step={self.step}"
            )

    def values(self) -> list[float]:
        count = int(math.floor((self.hi - self.lo) / self.step + 1e-9)) + 1
        return [float(v) for v in self.lo + self.step * np.arange(count)]


@dataclass(frozen=True)
class Space:
    dram: Axis
    ttl: Axis
    disks: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.disks:
            raise ValueError("at least one disk type is needed")
        for name in self.disks:
            disk_type(name)

    def grid(self) -> list[Point]:
        points = {
            Point.make(d, t, k)
            for d in self.dram.values()
            for t in self.ttl.values()
            for k in self.disks
        }
        return sorted(points)
