"""The CPU server that the simulator's calibration and fidelity runs measure, and its requests.

Every run uses the same flags as the simulator's profile: SmolLM2 (fp32), a device pool of
`DEVICE_TOKENS`, pages of `PAGE_TOKENS`, `MAX_RUNNING` requests; +DRAM adds HiCache with
`HOST_RATIO`; +disk adds our TTL disk tier with one static TTL.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from sglang_hicache_ext.sglang_ext.disk_tier.storage_backend import disk_tier_extra_config
from sglang_hicache_ext.sglang_ext.server.launcher import ServerConfig, flush_cache, running_server
from sglang_hicache_ext.sglang_ext.server.ports import free_port
from sglang_hicache_ext.sglang_ext.tools.streaming_client import (
    StreamedGeneration,
    stream_generate,
)

PAGE_TOKENS = 16
DEVICE_TOKENS = 8192
HOST_RATIO = 2.0
MAX_RUNNING = 16
DISK_TTL_S = 3600.0


def stream(url: str, input_ids: Sequence[int], max_new_tokens: int) -> StreamedGeneration:
    """One streamed greedy request of exactly `max_new_tokens` tokens (EOS ignored)."""
    body = {
        "input_ids": list(input_ids),
        "sampling_params": {
            "max_new_tokens": max_new_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
    }
    return stream_generate(url, body, timeout=1800)


def kv_bytes_per_token(model_path: Path) -> int:
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
def calibration_server(config: ServerConfig, log: Path) -> Iterator[str]:
    """A started and warmed-up server (empty caches); yields its URL."""
    with running_server(config, log_path=log) as running:
        _warm_up(running.url)
        yield running.url


def _warm_up(url: str) -> None:
    rng = np.random.default_rng(7)
    for length in (64, 512, 64):
        stream(url, random_ids(rng, length), 4)
    flush_cache(url)


def random_ids(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(1000, 40_000, size=n)]
