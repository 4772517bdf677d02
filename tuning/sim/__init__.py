"""Trace-driven simulator of SGLang serving with GPU, host-DRAM and disk KV tiers."""

from tuning.sim.config import DiskConfig, SimConfig
from tuning.sim.profile import Profile
from tuning.sim.result import SimResult, TierHits
from tuning.sim.simulator import simulate
from tuning.sim.trace import CONVERSATION_TRACE, SimRequest, TraceError, load_requests

__all__ = [
    "CONVERSATION_TRACE",
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
