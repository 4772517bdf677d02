"""Picking frontier configurations under user constraints, and the flags that realise them."""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from sglang_hicache_ext.tuning.pareto.evaluator import Evaluation
from sglang_hicache_ext.tuning.pareto.space import NO_DISK
from sglang_hicache_ext.tuning.sim.profile import Profile


@dataclass(frozen=True)
class Constraints:
    max_p99_ttft_ms: float = math.inf
    max_mean_ttft_ms: float = math.inf
    min_throughput_tok_s: float = 0.0
    max_cost_per_hour: float = math.inf

    def __post_init__(self) -> None:
        for name in (
            "max_p99_ttft_ms",
            "max_mean_ttft_ms",
            "min_throughput_tok_s",
            "max_cost_per_hour",
        ):
            value = getattr(self, name)
            if math.isnan(value) or value < 0:
                raise ValueError(f"constraint {name} must be >= 0, got {value!r}")

    def admits(self, evaluation: Evaluation) -> bool:
        r = evaluation.result
        return (
            r.p99_ttft_s * 1000 <= self.max_p99_ttft_ms
            and r.mean_ttft_s * 1000 <= self.max_mean_ttft_ms
            and r.throughput_tok_s >= self.min_throughput_tok_s
            and r.cost.usd_per_hour <= self.max_cost_per_hour
        )

    def describe(self) -> str:
        parts = [
            f"P99 TTFT <= {self.max_p99_ttft_ms:g} ms"
            if math.isfinite(self.max_p99_ttft_ms)
            else "",
            f"mean TTFT <= {self.max_mean_ttft_ms:g} ms"
            if math.isfinite(self.max_mean_ttft_ms)
            else "",
            f"throughput >= {self.min_throughput_tok_s:g} tok/s"
            if self.min_throughput_tok_s
            else "",
            f"cost <= {self.max_cost_per_hour:g} $/h"
            if math.isfinite(self.max_cost_per_hour)
            else "",
        ]
        return ", ".join(p for p in parts if p) or "no constraint"


def select(frontier: Sequence[Evaluation], constraints: Constraints) -> list[Evaluation]:
    """Frontier configurations meeting every constraint, cheapest per hour first."""
    chosen = [e for e in frontier if constraints.admits(e)]
    return sorted(chosen, key=lambda e: (e.result.cost.usd_per_hour, e.result.mean_ttft_s))


def closest_miss(frontier: Sequence[Evaluation], constraints: Constraints) -> str:
    """What the frontier can do at best on each constrained metric, for the infeasible message."""
    r = [e.result for e in frontier]
    return (
        f"best P99 TTFT {min(x.p99_ttft_s for x in r) * 1000:.0f} ms, "
        f"best mean TTFT {min(x.mean_ttft_s for x in r) * 1000:.0f} ms, "
        f"best throughput {max(x.throughput_tok_s for x in r):.0f} tok/s, "
        f"lowest cost {min(x.cost.usd_per_hour for x in r):.2f} $/h"
    )


def sglang_flags(evaluation: Evaluation, profile: Profile) -> list[str]:
    """SGLang server flags for one instance of the configuration."""
    point = evaluation.point
    flags = ["--radix-cache-backend", "hicache_ext"]
    if point.dram_gb > 0:
        flags += ["--enable-hierarchical-cache", "--hicache-size", f"{point.dram_gb:g}"]
    elif point.disk != NO_DISK:
        # Storage I/O goes through the host pool: keep the smallest one SGLang accepts.
        flags += ["--enable-hierarchical-cache", "--hicache-ratio", "1.1"]
    if point.disk != NO_DISK:
        # Our TTL disk tier (sglang_hicache_ext.sglang_ext.disk_tier.storage_backend), one TTL for all pages as simulated.
        disk = {
            "backend_name": "hicache_ext_disk",
            "module_path": "sglang_hicache_ext.sglang_ext.disk_tier.storage_backend",
            "class_name": "GroupTTLDiskStorage",
            "interface_v1": 1,
            "disk_dir": f"/mnt/{point.disk}",
            "capacity_bytes": evaluation.result.disk_gb * 1e9,
            "ttl_policy": "static",
            "initial_ttl_s": point.ttl_s,
        }
        flags += [
            "--hicache-storage-backend",
            "dynamic",
            "--hicache-storage-backend-extra-config",
            json.dumps(disk, separators=(",", ":")),
        ]
    return flags


def hicache_ratio(evaluation: Evaluation, profile: Profile) -> float:
    """The `--hicache-ratio` (host pool / device KV pool) equivalent to `--hicache-size`."""
    device_tokens = profile.running_kv_tokens + profile.prefix_cache_tokens
    return evaluation.point.dram_gb * 1e9 / (device_tokens * profile.kv_bytes_per_token)


def provisioning(evaluation: Evaluation) -> dict[str, object] | None:
    """What to provision for the configuration's disk tier (None: no disk tier). Not settings:
    the server's disk tier is configured entirely by the flags of `sglang_flags`."""
    point, r = evaluation.point, evaluation.result
    if point.disk == NO_DISK:
        return None
    return {
        "disk_type": point.disk,
        "volume_gb": round(r.disk_gb, 1),
        "expected_bandwidth_mb_s": round(r.disk_bandwidth_mb_s, 1),
    }


def describe(evaluation: Evaluation, profile: Profile) -> str:
    point, r = evaluation.point, evaluation.result
    # Quoted for a shell: the extra-config is JSON.
    flags = shlex.join(sglang_flags(evaluation, profile))
    lines = [
        f"DRAM {point.dram_gb:g} GB/instance, disk TTL {point.ttl_s:g} s, disk {point.disk}: "
        f"mean TTFT {r.mean_ttft_s * 1000:.0f} ms, P99 TTFT {r.p99_ttft_s * 1000:.0f} ms, "
        f"throughput {r.throughput_tok_s:.0f} tok/s, cost {r.cost.usd_per_hour:.2f} $/h "
        f"({r.cost.total_usd:.2f} $ for the trace)",
        f"  sglang flags: {flags}"
        + (
            f"  (equivalently --hicache-ratio {hicache_ratio(evaluation, profile):.2f})"
            if point.dram_gb > 0
            else ""
        ),
    ]
    volume = provisioning(evaluation)
    if volume is not None:
        lines.append(
            f"  provision: {volume['volume_gb']:g} GB of {volume['disk_type']} at /mnt/{point.disk} "
            f"(about {volume['expected_bandwidth_mb_s']:g} MB/s of reads expected)"
        )
    return "\n".join(lines)
