"""What a simulation run reports."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from sglang_hicache_ext.tuning.cost import CostBreakdown


class TierHits(NamedTuple):
    """Fractions of all prompt blocks served by each tier (the rest were recomputed)."""

    gpu: float
    dram: float
    disk: float

    @property
    def total(self) -> float:
        return self.gpu + self.dram + self.disk


@dataclass(frozen=True)
class SimResult:
    requests: int
    mean_ttft_s: float
    p90_ttft_s: float
    p99_ttft_s: float
    mean_queue_s: float
    throughput_tok_s: float  # prompt + generated tokens over the makespan
    makespan_s: float  # first arrival to last completion
    hit_ratio: TierHits
    disk_gb: float  # provisioned
    disk_bandwidth_mb_s: float
    disk_writes_dropped: int
    cost: CostBreakdown

    def to_json(self) -> dict[str, Any]:
        values = asdict(self)
        values["hit_ratio"] = {**self.hit_ratio._asdict(), "total": self.hit_ratio.total}
        values["cost"]["total_usd"] = self.cost.total_usd
        return values

    @classmethod
    def from_json(cls, values: Mapping[str, Any]) -> SimResult:
        """The inverse of `to_json` (derived totals are dropped and recomputed)."""
        hits, cost = values["hit_ratio"], values["cost"]
        return cls(
            **{
                **values,
                "hit_ratio": TierHits(hits["gpu"], hits["dram"], hits["disk"]),
                "cost": CostBreakdown(
                    cost["gpu_usd"], cost["dram_usd"], cost["disk_usd"], cost["usd_per_hour"]
                ),
            }
        )
