"""Trace-driven simulator of SGLang serving with GPU, host-DRAM and disk KV tiers."""

from sglang_hicache_ext.tuning.sim.config import DiskConfig, SimConfig
from sglang_hicache_ext.tuning.sim.profile import Profile
from sglang_hicache_ext.tuning.sim.result import SimResult, TierHits
from sglang_hicache_ext.tuning.sim.simulator import simulate
from sglang_hicache_ext.tuning.trace import (
    SimRequest,
    TraceError,
    load_requests,
)

__all__ = [
    "DiskConfig",
    "Profile",
    "SimConfig",
    "SimRequest",
    "SimResult",
    "TierHits",
    "TraceError",
    "load_requests",
    "simulate",
]
