"""Measurements of a running server that the ratio tuner needs: TTFTs and chunk load times.

TTFT is the client latency of `/generate` with `max_new_tokens=1` after `/flush_cache` (no
prefix-tree hit), the median over the calibration prompts. A fused request reports where its
chunks came from (`chunks_by_tier`) and, for chunks streamed from disk, what reading them cost
(`load`); the tuner refuses measurements whose chunks did not come from the tier it tunes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import requests


class CalibrationPrompt(NamedTuple):
    documents: tuple[str, ...]  # registered as chunks
    text: str  # the whole prompt (documents in some order, then the question)


class FusedRun(NamedTuple):
    ttft_s: float
    info: dict[str, Any]  # meta_info.hicache_ext_fusion of the request's first round


class TierMismatchError(RuntimeError):
    """The server served the chunks from another tier than the one being measured."""


def flush_cache(url: str) -> None:
    for _ in range(30):  # refused while requests are running; they finish soon
        if requests.post(url + "/flush_cache", timeout=60).status_code == 200:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{url}/flush_cache kept failing")


def register(url: str, prompts: Sequence[CalibrationPrompt]) -> None:
    for document in {d for prompt in prompts for d in prompt.documents}:
        response = requests.post(url + "/chunks", json={"text": document}, timeout=600)
        if response.status_code != 200:
            raise RuntimeError(f"/chunks answered {response.status_code}: {response.text}")


def timed_generate(url: str, text: str, custom: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    flush_cache(url)
    body = {
        "text": text,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0, "custom_params": custom},
    }
    began = time.perf_counter()
    response = requests.post(url + "/generate", json=body, timeout=1800)
    seconds = time.perf_counter() - began
    if response.status_code != 200:
        raise RuntimeError(f"/generate answered {response.status_code}: {response.text}")
    return seconds, response.json()["meta_info"]


def full_prefill(url: str, text: str) -> tuple[float, int]:
    """TTFT of the normal prefill and the prompt's token count."""
    seconds, meta = timed_generate(url, text, {})
    return seconds, int(meta["prompt_tokens"])


def fused(url: str, text: str, tier: str | None, **options: Any) -> FusedRun:
    """One fused request (`options` are custom_params keys without the `fusion_` prefix)."""
    custom = {"fusion": True, **{f"fusion_{k}": v for k, v in options.items()}}
    seconds, meta = timed_generate(url, text, custom)
    (info, *_) = meta.get("hicache_ext_fusion") or [None]
    if not info or not info.get("fused"):
        raise RuntimeError(f"the request was not fused: {info}")
    if tier is not None and set(info["chunks_by_tier"]) != {tier}:
        raise TierMismatchError(
            f"chunks came from {info['chunks_by_tier']}, not only from {tier!r}; serve them from "
            "that tier (disk: a chunk_store_bytes smaller than one chunk keeps them there)"
        )
    return FusedRun(seconds, info)


def median_fused_ttft(
    url: str, prompts: Sequence[CalibrationPrompt], tier: str | None, **options: Any
) -> float:
    return statistics.median(fused(url, p.text, tier, **options).ttft_s for p in prompts)


def chunk_geometry(url: str) -> tuple[int, float]:
    """Layers of the registered chunks and their K+V bytes per token and layer."""
    chunks = requests.get(url + "/chunks", timeout=60).json()["chunks"]
    if not chunks:
        raise RuntimeError("the server holds no chunks")
    layers = int(chunks[0]["num_layers"])
    tokens = sum(int(c["num_tokens"]) for c in chunks)
    # nbytes also counts the float32 frequency scores (4 bytes per token and layer).
    per_token_layer = sum(int(c["nbytes"]) for c in chunks) / (tokens * layers) - 4.0
    return layers, per_token_layer
