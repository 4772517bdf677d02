"""`fidelity`: replay a scaled trace slice on the real server and through the simulator, compare.

Per deployment (GPU-only, +DRAM, +disk with our TTL disk tier) a fresh server gets the slice
(`sglang_hicache_ext.tuning.sim.scaled_slice`) open-loop, and the simulator runs it with the
calibrated profile; mean TTFT, hit ratio and throughput are compared against `LIMITS`.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np
from tqdm import tqdm

from sglang_hicache_ext.sglang_ext.tools.calibration_server import (
    DEVICE_TOKENS,
    DISK_TTL_S,
    HOST_RATIO,
    calibration_server,
    server_config,
    stream,
)
from sglang_hicache_ext.sglang_ext.tools.streaming_client import StreamedGeneration
from sglang_hicache_ext.tuning.cost import GB
from sglang_hicache_ext.tuning.sim.config import DiskConfig, SimConfig
from sglang_hicache_ext.tuning.sim.profile import Profile
from sglang_hicache_ext.tuning.sim.scaled_slice import ScaledRequest, SliceSpec, scale_slice
from sglang_hicache_ext.tuning.sim.simulator import simulate
from sglang_hicache_ext.tuning.trace import load_requests

# Fidelity acceptance (issue 5): mean TTFT within 25 %, hit ratio within 5 points, throughput 15 %.
LIMITS = MappingProxyType({"mean_ttft": 0.25, "hit_ratio_points": 0.05, "throughput": 0.15})
SIM_KEYS = ("mean_ttft_s", "p90_ttft_s", "throughput_tok_s", "makespan_s", "hit_ratio")


@dataclasses.dataclass(frozen=True)
class Deployment:
    name: str
    hierarchical: bool
    disk: bool

    def sim_config(self, profile: Profile) -> SimConfig:
        dram_gb = (
            HOST_RATIO * DEVICE_TOKENS * profile.kv_bytes_per_token / GB
            if self.hierarchical
            else 0.0
        )
        disk = (
            DiskConfig("essd_pl1", ttl_s=DISK_TTL_S, capacity_gb=50.0, prefetch_policy="timeout")
            if self.disk
            else None
        )
        return SimConfig(instances=1, dram_gb=dram_gb, disk=disk)


DEPLOYMENTS = (
    Deployment("gpu_only", hierarchical=False, disk=False),
    Deployment("dram", hierarchical=True, disk=False),
    Deployment("disk", hierarchical=True, disk=True),
)


class ServerRun(NamedTuple):
    mean_ttft_s: float
    p90_ttft_s: float
    hit_ratio: float
    hit_by_tier: dict[str, float]
    throughput_tok_s: float
    makespan_s: float


def replay_on_server(url: str, requests_: Sequence[ScaledRequest]) -> ServerRun:
    """Open-loop replay: each request is sent at its arrival time, on its own thread."""
    results: list[StreamedGeneration | None] = [None] * len(requests_)
    errors: list[BaseException] = []
    start = time.perf_counter()
    progress = tqdm(total=len(requests_), desc="replay", unit="req", leave=False, disable=None)

    def send(index: int) -> None:
        request = requests_[index]
        delay = request.arrival_s - (time.perf_counter() - start)
        if delay > 0:
            time.sleep(delay)
        try:
            results[index] = stream(url, request.input_ids, request.output_tokens)
        except BaseException as error:  # reported after the replay
            errors.append(error)
        progress.update()

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(len(requests_))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    progress.close()
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed; first: {errors[0]!r}")
    timings = [t for t in results if t is not None]
    return _server_run(requests_, timings)


def _server_run(
    requests_: Sequence[ScaledRequest], timings: Sequence[StreamedGeneration]
) -> ServerRun:
    finish = max(r.arrival_s + t.latency_s for r, t in zip(requests_, timings, strict=True))
    tokens = sum(len(r.input_ids) + r.output_tokens for r in requests_)
    prompt = sum(len(r.input_ids) for r in requests_)
    tiers = {"device": 0, "host": 0, "storage": 0}
    cached = 0
    for timing in timings:
        cached += int(timing.meta.get("cached_tokens", 0))
        for tier in tiers:
            tiers[tier] += int((timing.meta.get("cached_tokens_details") or {}).get(tier, 0))
    if not any(tiers.values()):
        tiers["device"] = cached  # without HiCache the details are absent: all on device
    ttfts = [t.ttft_s for t in timings]
    return ServerRun(
        mean_ttft_s=statistics.mean(ttfts),
        p90_ttft_s=float(np.percentile(ttfts, 90)),
        hit_ratio=cached / prompt,
        hit_by_tier={tier: n / prompt for tier, n in tiers.items()},
        throughput_tok_s=tokens / (finish - requests_[0].arrival_s),
        makespan_s=finish - requests_[0].arrival_s,
    )


def compare(server: ServerRun, sim: dict[str, Any]) -> dict[str, Any]:
    ttft_error = sim["mean_ttft_s"] / server.mean_ttft_s - 1.0
    hit_points = sim["hit_ratio"]["total"] - server.hit_ratio
    throughput_error = sim["throughput_tok_s"] / server.throughput_tok_s - 1.0
    return {
        "mean_ttft_rel_error": ttft_error,
        "hit_ratio_points": hit_points,
        "throughput_rel_error": throughput_error,
        "within_limits": abs(ttft_error) <= LIMITS["mean_ttft"]
        and abs(hit_points) <= LIMITS["hit_ratio_points"]
        and abs(throughput_error) <= LIMITS["throughput"],
    }


def fidelity(
    model_path: Path, profile: Profile, spec: SliceSpec, trace: Path, workdir: Path
) -> dict[str, Any]:
    """Every deployment on a fresh server and in the simulator; the report of `fidelity`."""
    scaled = scale_slice(load_requests(trace), spec)
    sim_requests = [r.as_sim_request() for r in scaled]
    rows = {}
    for deployment in tqdm(DEPLOYMENTS, desc="deployments", unit="deployment", disable=None):
        sim = simulate(sim_requests, deployment.sim_config(profile), profile).to_json()
        config = server_config(
            model_path,
            hierarchical=deployment.hierarchical,
            disk_dir=workdir / f"disk-{deployment.name}" if deployment.disk else None,
        )
        with calibration_server(config, workdir / f"{deployment.name}.log") as url:
            server = replay_on_server(url, scaled)
        rows[deployment.name] = {
            "server": server._asdict(),
            "sim": {k: sim[k] for k in SIM_KEYS},
            "comparison": compare(server, sim),
        }
        tqdm.write(json.dumps({deployment.name: rows[deployment.name]["comparison"]}))
    return {
        "slice": dataclasses.asdict(spec),
        "trace": str(trace),
        "requests": len(scaled),
        "prompt_tokens_mean": statistics.mean(len(r.input_ids) for r in scaled),
        "output_tokens_mean": statistics.mean(r.output_tokens for r in scaled),
        "limits": LIMITS,
        "deployments": rows,
    }
