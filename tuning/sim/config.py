"""What one simulation run is asked to model: instances, routing and the storage tiers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from sglang_hicache_ext.tuning.cost import disk_type

DiskPolicy = Literal["ttl", "lru"]
PrefetchPolicy = Literal["best_effort", "timeout"]
Routing = Literal["affinity", "round_robin"]


@dataclass(frozen=True)
class DiskConfig:
    """The disk tier, shared by all instances (one cloud volume behind the storage backend).

    `capacity_gb=None` provisions the TTL policy's peak footprint on the trace (plus 10%
    headroom); an LRU disk needs an explicit capacity. Write-through copies that would wait more
    than `max_write_backlog_s` behind earlier I/O are dropped, as a bounded backup queue does.

    Prefetch (SGLang's `--hicache-storage-prefetch-policy`): `best_effort` uses only the time a
    request waits in the queue anyway; `timeout` (SGLang 0.5.23's default) holds a request until
    its prefetch is done or `prefetch_timeout_base_s + prefetch_timeout_per_ki_token_s` x its
    disk tokens / 1024 have passed, while other requests go ahead. Prefetches shorter than
    `prefetch_threshold_tokens` are not started (SGLang's `prefetch_threshold`).
    """

    disk_type: str = "essd_pl1"
    policy: DiskPolicy = "ttl"
    ttl_s: float = 600.0
    capacity_gb: float | None = None
    max_write_backlog_s: float = 2.0
    prefetch_policy: PrefetchPolicy = "best_effort"
    prefetch_timeout_base_s: float = 1.0
    prefetch_timeout_per_ki_token_s: float = 0.25
    prefetch_threshold_tokens: int = 256

    def __post_init__(self) -> None:
        disk_type(self.disk_type)
        if self.prefetch_policy not in ("best_effort", "timeout"):
            raise ValueError(
                f"prefetch policy must be 'best_effort' or 'timeout', got {self.prefetch_policy!r}"
            )
        for name in ("prefetch_timeout_base_s", "prefetch_timeout_per_ki_token_s"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be finite and >= 0")
        if self.prefetch_threshold_tokens < 0:
            raise ValueError(
                "prefetch_threshold_tokens must be >= 0"
            )  # raises a clear error for an unknown type
        if self.policy not in ("ttl", "lru"):
            raise ValueError(f"disk policy must be 'ttl' or 'lru', got {self.policy!r}")
        if not math.isfinite(self.ttl_s) or self.ttl_s < 0:
            raise ValueError(f"disk TTL must be finite and >= 0 s, got {self.ttl_s!r}")
        if self.capacity_gb is not None and (
            not math.isfinite(self.capacity_gb) or self.capacity_gb < 0
        ):
            raise ValueError(f"disk capacity must be finite and >= 0 GB, got {self.capacity_gb!r}")
        if self.policy == "lru" and self.capacity_gb is None:
            raise ValueError("an LRU disk needs capacity_gb")
        if self.max_write_backlog_s < 0:
            raise ValueError("max_write_backlog_s must be >= 0")


@dataclass(frozen=True)
class SimConfig:
    """A deployment: `dram_gb` is host DRAM for KV per instance (SGLang's `--hicache-size`).

    Routing `affinity` sends a request to the instance owning its conversation (hash of its first
    block after the shared system block), so multi-turn prefixes stay on one instance, as a
    cache-aware router does; `round_robin` ignores content.
    """

    instances: int = 1
    dram_gb: float = 0.0
    disk: DiskConfig | None = None
    routing: Routing = "affinity"
    gpu_prefix_cache: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.instances, bool) or not isinstance(self.instances, int):
            raise ValueError(f"instances must be an integer, got {self.instances!r}")
        if self.instances < 1:
            raise ValueError(f"instances must be >= 1, got {self.instances}")
        if not math.isfinite(self.dram_gb) or self.dram_gb < 0:
            raise ValueError(f"DRAM capacity must be finite and >= 0 GB, got {self.dram_gb!r}")
        if self.routing not in ("affinity", "round_robin"):
            raise ValueError(f"routing must be 'affinity' or 'round_robin', got {self.routing!r}")
