"""`profile`: measure the CPU server and fit the simulator's `Profile` to it.

Prefill times of requests alone at several new/cached lengths and decode step times at several
batch sizes and contexts (fitted by `sglang_hicache_ext.tuning.sim.calibrate.fit_profile`), then
host -> device and disk -> host bandwidths from the TTFT of one prompt served by the device,
host and disk tiers.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import requests
from tqdm import tqdm

from sglang_hicache_ext.sglang_ext.server.launcher import flush_cache
from sglang_hicache_ext.sglang_ext.tools.calibration_server import (
    DEVICE_TOKENS,
    PAGE_TOKENS,
    calibration_server,
    kv_bytes_per_token,
    random_ids,
    server_config,
    stream,
)
from sglang_hicache_ext.tuning.sim.calibrate import DecodeSample, PrefillSample, fit_profile
from sglang_hicache_ext.tuning.sim.profile import Profile

PREFILL_CACHED = (0, 512, 2048)
PREFILL_NEW = (32, 128, 512, 1024, 2048)
DECODE_BATCHES = (1, 2, 4, 8)
DECODE_CONTEXTS = (128, 1024)


def measure_prefill(url: str, repeats: int = 3) -> list[PrefillSample]:
    """Requests alone: median TTFT per (new tokens, cached tokens)."""
    rng = np.random.default_rng(11)
    samples = []
    grid = list(itertools.product(PREFILL_CACHED, PREFILL_NEW))
    for cached, new in tqdm(grid, desc="prefill", unit="shape", disable=None):
        ttfts, hits = [], []
        for _ in range(repeats):
            prefix = random_ids(rng, cached)
            if cached:
                stream(url, prefix, 1)
            timing = stream(url, prefix + random_ids(rng, new), 1)
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
    grid = list(itertools.product(DECODE_BATCHES, DECODE_CONTEXTS))
    for batch, context in tqdm(grid, desc="decode", unit="shape", disable=None):
        prompts = [random_ids(rng, context) for _ in range(batch)]
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
    for _ in tqdm(range(repeats), desc="tier bandwidths", unit="repeat", disable=None):
        flush_cache(url)
        prompt = random_ids(rng, prompt_tokens)
        stream(url, prompt, 1)
        device.append(stream(url, prompt, 1).ttft_s)
        for _ in range(3):  # fillers push the prompt off the device pool, into the host pool
            stream(url, random_ids(rng, DEVICE_TOKENS // 3 + 256), 1)
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
    """Both servers measured, the profile fitted; the report of `profile`."""
    kv_bytes = kv_bytes_per_token(model_path)
    plain = server_config(model_path, hierarchical=False)
    with calibration_server(plain, workdir / "plain.log") as url:
        limits = requests.get(url + "/server_info", timeout=60).json()
        prefill = measure_prefill(url)
        decode = measure_decode(url)
    tiered = server_config(model_path, hierarchical=True, disk_dir=workdir / "disk")
    with calibration_server(tiered, workdir / "tiers.log") as url:
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
        "fit": fit_errors(profile, prefill, decode),
        "server_limits": {
            k: limits[k]
            for k in ("max_total_num_tokens", "max_running_requests", "chunked_prefill_size")
        },
    }


def fit_errors(
    profile: Profile, prefill: Sequence[PrefillSample], decode: Sequence[DecodeSample]
) -> dict[str, float]:
    """Mean relative error of the fitted profile on the samples it was fitted to."""
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
