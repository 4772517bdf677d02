"""Calibrate the serving simulator on the real CPU SGLang server, and check its fidelity.

    python -m sglang_hicache_ext.sglang_ext.tools.sim_calibration profile --out profile.json
    python -m sglang_hicache_ext.sglang_ext.tools.sim_calibration fidelity --profile profile.json --out fidelity.json

`profile` measures, on SmolLM2 with this repository's CPU server flags: prefill times alone at
several new/cached lengths and decode step times at several batch sizes and contexts (fitted by
`sglang_hicache_ext.tuning.sim.calibrate.fit_profile`), then host -> device and disk -> host bandwidths from the TTFT
of a prompt served by the device, host and disk tiers. `fidelity` replays a scaled slice of a
trace (`sglang_hicache_ext.tuning.sim.scaled_slice`) open-loop against a fresh server per configuration (GPU-only,
+DRAM, +disk with our TTL disk tier) and through the simulator with the calibrated profile, and
compares mean TTFT, hit ratio and throughput.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import requests
from sglang_hicache_ext.sglang_ext.disk_tier.storage_backend import disk_tier_extra_config
from sglang_hicache_ext.sglang_ext.server.launcher import (
    ServerConfig,
    flush_cache,
    free_port,
    running_server,
)
from sglang_hicache_ext.tuning.cost import GB
from sglang_hicache_ext.tuning.sim.calibrate import DecodeSample, PrefillSample, fit_profile
from sglang_hicache_ext.tuning.sim.config import DiskConfig, SimConfig
from sglang_hicache_ext.tuning.sim.profile import Profile
from sglang_hicache_ext.tuning.sim.scaled_slice import ScaledRequest, SliceSpec, scale_slice
from sglang_hicache_ext.tuning.sim.simulator import simulate
from sglang_hicache_ext.tuning.trace import CONVERSATION_TRACE, load_requests

PAGE_TOKENS = 16
DEVICE_TOKENS = 8192
HOST_RATIO = 2.0
MAX_RUNNING = 16
DISK_TTL_S = 3600.0
# Fidelity acceptance (issue 5): mean TTFT within 25 %, hit ratio within 5 points, throughput 15 %.
LIMITS = {"mean_ttft": 0.25, "hit_ratio_points": 0.05, "throughput": 0.15}


class Timing(NamedTuple):
    ttft_s: float
    latency_s: float
    token_times_s: tuple[float, ...]  # arrival of each streamed chunk, from the send
    meta: dict[str, Any]


def stream(url: str, input_ids: Sequence[int], max_new_tokens: int) -> Timing:
    """One streamed greedy request of exactly `max_new_tokens` tokens (EOS ignored)."""
    body = {
        "input_ids": list(input_ids),
        "stream": True,
        "sampling_params": {
            "max_new_tokens": max_new_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
    }
    start = time.perf_counter()
    times: list[float] = []
    meta: dict[str, Any] = {}
    with requests.post(url + "/generate", json=body, stream=True, timeout=1800) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            times.append(time.perf_counter() - start)
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"server error: {chunk['error']}")
            meta = chunk.get("meta_info", meta)
    if not times:
        raise RuntimeError("the server streamed nothing")
    return Timing(times[0], times[-1], tuple(times), meta)


def _kv_bytes_per_token(model_path: Path) -> int:
    config = json.loads((model_path / "config.json").read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    return int(config["num_hidden_layers"] * 2 * heads * head_dim * 4)  # fp32 KV


def server_config(
    model_path: Path,
    *,
    hierarchical: bool,
    disk_dir: Path | None = None,
    disk_ttl_s: float = DISK_TTL_S,
) -> ServerConfig:
    """The flags every calibration and fidelity run uses (same as the simulator's profile)."""
    extra = ["--max-running-requests", str(MAX_RUNNING)]
    storage = None
    if hierarchical:
        extra += ["--hicache-ratio", str(HOST_RATIO)]
    if disk_dir is not None:
        storage = "dynamic"
        extra += [
            "--hicache-storage-backend-extra-config",
            json.dumps(
                {
                    **disk_tier_extra_config(str(disk_dir)),
                    "capacity_bytes": 50e9,
                    "ttl_policy": "static",
                    "initial_ttl_s": disk_ttl_s,
                }
            ),
        ]
    return ServerConfig(
        model_path=str(model_path),
        port=free_port(),
        max_total_tokens=DEVICE_TOKENS,
        page_size=PAGE_TOKENS,
        hierarchical_cache=hierarchical,
        hicache_storage_backend=storage,
        extra_args=tuple(extra),
    )


@contextmanager
def _server(config: ServerConfig, log: Path) -> Iterator[str]:
    with running_server(config, log_path=log) as running:
        _warm_up(running.url)
        yield running.url


def _warm_up(url: str) -> None:
    rng = np.random.default_rng(7)
    for length in (64, 512, 64):
        stream(url, _random_ids(rng, length), 4)
    flush_cache(url)


def _random_ids(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(1000, 40_000, size=n)]


# -- calibration -------------------------------------------------------------------------------


def measure_prefill(url: str, repeats: int = 3) -> list[PrefillSample]:
    """Requests alone: median TTFT per (new tokens, cached tokens)."""
    rng = np.random.default_rng(11)
    samples = []
    for cached in (0, 512, 2048):
        for new in (32, 128, 512, 1024, 2048):
            ttfts, hits = [], []
            for _ in range(repeats):
                prefix = _random_ids(rng, cached)
                if cached:
                    stream(url, prefix, 1)
                timing = stream(url, prefix + _random_ids(rng, new), 1)
                ttfts.append(timing.ttft_s)
                hits.append(int(timing.meta.get("cached_tokens", 0)))
            hit = int(statistics.median(hits))
            samples.append(PrefillSample(cached + new - hit, hit, statistics.median(ttfts)))
            flush_cache(url)
    return samples


def measure_decode(url: str, steps: int = 33) -> list[DecodeSample]:
    """Batches of concurrent requests: median time per decode step after the first token."""
    rng = np.random.default_rng(13)
    samples = []
    for batch in (1, 2, 4, 8):
        for context in (128, 1024):
            prompts = [_random_ids(rng, context) for _ in range(batch)]
            with ThreadPoolExecutor(batch) as pool:
                timings = list(pool.map(lambda ids: stream(url, ids, steps), prompts))
            per_step = [
                (t.token_times_s[-1] - t.token_times_s[0]) / max(1, len(t.token_times_s) - 1)
                for t in timings
            ]
            mean_context = batch * (context + steps / 2)
            samples.append(DecodeSample(batch, int(mean_context), statistics.median(per_step)))
            flush_cache(url)
    return samples


def measure_tier_bandwidths(
    url: str, kv_bytes_per_token: int, prompt_tokens: int = 2048, repeats: int = 3
) -> dict[str, float]:
    """Bytes/s of host -> device loads and disk -> host prefetches, from TTFT differences of one
    prompt served by the device, the host and the disk tier (server with HiCache + disk)."""
    rng = np.random.default_rng(17)
    device, host, disk, host_tokens, disk_tokens = [], [], [], [], []
    for _ in range(repeats):
        flush_cache(url)
        prompt = _random_ids(rng, prompt_tokens)
        stream(url, prompt, 1)
        device.append(stream(url, prompt, 1).ttft_s)
        for _ in range(3):  # fillers push the prompt off the device pool, into the host pool
            stream(url, _random_ids(rng, DEVICE_TOKENS // 3 + 256), 1)
        timing = stream(url, prompt, 1)
        details = timing.meta.get("cached_tokens_details") or {}
        host.append(timing.ttft_s)
        host_tokens.append(int(details.get("host", 0)))
        time.sleep(2.0)  # write-through to disk is asynchronous
        flush_cache(url)  # drops device and host; the disk tier stays
        timing = stream(url, prompt, 1)
        details = timing.meta.get("cached_tokens_details") or {}
        disk.append(timing.ttft_s)
        disk_tokens.append(int(details.get("storage", 0)))
    host_s = statistics.median(host) - statistics.median(device)
    disk_s = statistics.median(disk) - statistics.median(host)
    host_bytes = statistics.median(host_tokens) * kv_bytes_per_token
    disk_bytes = statistics.median(disk_tokens) * kv_bytes_per_token
    return {
        "ttft_device_s": statistics.median(device),
        "ttft_host_s": statistics.median(host),
        "ttft_disk_s": statistics.median(disk),
        "host_tokens": statistics.median(host_tokens),
        "disk_tokens": statistics.median(disk_tokens),
        # A load hidden in the noise is fast: bound it by the smallest resolvable time.
        "host_to_gpu_bytes_s": host_bytes / max(host_s, 1e-3),
        "disk_bytes_s": disk_bytes / max(disk_s, 1e-3),
    }


def calibrate(model_path: Path, workdir: Path) -> dict[str, Any]:
    kv_bytes = _kv_bytes_per_token(model_path)
    with _server(server_config(model_path, hierarchical=False), workdir / "plain.log") as url:
        limits = requests.get(url + "/server_info", timeout=60).json()
        prefill = measure_prefill(url)
        decode = measure_decode(url)
    disk_config = server_config(model_path, hierarchical=True, disk_dir=workdir / "disk")
    with _server(disk_config, workdir / "tiers.log") as url:
        bandwidths = measure_tier_bandwidths(url, kv_bytes)
    base = Profile(
        kv_bytes_per_token=kv_bytes,
        block_tokens=PAGE_TOKENS,
        running_kv_tokens=int(limits["max_total_num_tokens"]),
        # One pool holds running and cached KV in SGLang; unused by running requests, it caches.
        prefix_cache_tokens=int(limits["max_total_num_tokens"]),
        max_running_requests=int(limits["max_running_requests"]),
        # Chunked prefill caps the new tokens of one prefill batch.
        max_prefill_tokens=int(limits["chunked_prefill_size"]),
        host_to_gpu_bytes_s=bandwidths["host_to_gpu_bytes_s"],
        disk_bytes_s=bandwidths["disk_bytes_s"],
    )
    profile = fit_profile(prefill, decode, base)
    return {
        "profile": profile.to_json(),
        "samples": {
            "prefill": [s._asdict() for s in prefill],
            "decode": [s._asdict() for s in decode],
            "tiers": bandwidths,
        },
        "fit": _fit_errors(profile, prefill, decode),
        "server_limits": {
            k: limits[k]
            for k in ("max_total_num_tokens", "max_running_requests", "chunked_prefill_size")
        },
    }


def _fit_errors(
    profile: Profile, prefill: Sequence[PrefillSample], decode: Sequence[DecodeSample]
) -> dict[str, float]:
    pre = [
        abs(
            profile.prefill_base_s
            + profile.prefill_compute_s(s.new_tokens, s.cached_tokens)
            - s.seconds
        )
        / s.seconds
        for s in prefill
    ]
    dec = [
        abs(profile.decode_steps_s(s.batch, s.context_tokens, 1) - s.seconds) / s.seconds
        for s in decode
    ]
    return {
        "prefill_mean_rel_error": statistics.mean(pre),
        "decode_mean_rel_error": statistics.mean(dec),
    }


# -- fidelity ----------------------------------------------------------------------------------


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
    results: list[Timing | None] = [None] * len(requests_)
    errors: list[BaseException] = []
    start = time.perf_counter()

    def send(index: int) -> None:
        request = requests_[index]
        delay = request.arrival_s - (time.perf_counter() - start)
        if delay > 0:
            time.sleep(delay)
        try:
            results[index] = stream(url, request.input_ids, request.output_tokens)
        except BaseException as error:  # reported after the replay
            errors.append(error)

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(len(requests_))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed; first: {errors[0]!r}")
    timings = [t for t in results if t is not None]
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
    scaled = scale_slice(load_requests(trace), spec)
    sim_requests = [r.as_sim_request() for r in scaled]
    rows = {}
    for deployment in DEPLOYMENTS:
        sim = simulate(sim_requests, deployment.sim_config(profile), profile).to_json()
        config = server_config(
            model_path,
            hierarchical=deployment.hierarchical,
            disk_dir=workdir / f"disk-{deployment.name}" if deployment.disk else None,
        )
        with _server(config, workdir / f"{deployment.name}.log") as url:
            server = replay_on_server(url, scaled)
        rows[deployment.name] = {
            "server": server._asdict(),
            "sim": {
                k: sim[k]
                for k in (
                    "mean_ttft_s",
                    "p90_ttft_s",
                    "throughput_tok_s",
                    "makespan_s",
                    "hit_ratio",
                )
            },
            "comparison": compare(server, sim),
        }
        print(json.dumps({deployment.name: rows[deployment.name]["comparison"]}), flush=True)
    return {
        "slice": dataclasses.asdict(spec),
        "trace": str(trace),
        "requests": len(scaled),
        "prompt_tokens_mean": statistics.mean(len(r.input_ids) for r in scaled),
        "output_tokens_mean": statistics.mean(r.output_tokens for r in scaled),
        "limits": LIMITS,
        "deployments": rows,
    }


# -- CLI ---------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_hicache_ext.sglang_ext.tools.sim_calibration", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    prof = sub.add_parser("profile", help="measure the CPU server and write the simulator profile")
    prof.add_argument("--out", type=Path, required=True)
    fid = sub.add_parser(
        "fidelity", help="replay a scaled trace slice on the server and the simulator"
    )
    fid.add_argument("--profile", type=Path, required=True, help="output of `profile`")
    fid.add_argument("--trace", type=Path, default=CONVERSATION_TRACE)
    fid.add_argument("--first", type=int, default=0)
    fid.add_argument("--requests", type=int, default=200)
    fid.add_argument("--conversation-stride", type=int, default=16)
    fid.add_argument("--time-scale", type=float, default=0.5)
    fid.add_argument("--out", type=Path, required=True)
    for command in (prof, fid):
        command.add_argument(
            "--workdir", type=Path, default=Path("/tmp/sglang-ext-sim-calibration")
        )
    args = parser.parse_args(argv)

    from scripts.prepare_models import SMOLLM2, prepare

    model_path = prepare(SMOLLM2)
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.command == "profile":
        report = calibrate(model_path, args.workdir)
        profile = report["profile"]
    else:
        calibrated = json.loads(args.profile.read_text())
        profile = Profile.from_mapping(
            calibrated.get("profile", calibrated), source=str(args.profile)
        )
        spec = SliceSpec(
            first=args.first,
            count=args.requests,
            time_scale=args.time_scale,
            conversation_stride=args.conversation_stride,
        )
        report = {
            "profile": profile.to_json(),
            **fidelity(model_path, profile, spec, args.trace, args.workdir),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
