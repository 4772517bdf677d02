"""TTFT of fused prefills on a measured GPU: the chunk tiers' reuse (non-prefix, per document)
turned into time, for traces replayed against host memory's retention.

A request's prompt of N tokens reuses R of them from stored chunks, each read from host memory
(dense or int8) or from the disk tier. Its TTFT is modelled from `fusion_gpu`'s measurements on
one GPU (`benchmarks/results/fusion_gpu_*.json`: the full prefill and the fused one, every
document token reused from GPU-resident chunks, at a few prompt lengths):

    compute(N, s) = (1 - s) * full(N) + s * fused(N),   s = R / N
    TTFT = compute + host bytes / h2d + disk bytes / disk rate (+ their h2d)

`full` and `fused` are interpolated linearly between the measured lengths and scaled in
proportion below the shortest (above the longest: the last two points' slope). Loads are
counted serially (the measured overlap hides only part of them: `host_overlapped` against `gpu`
at 16K), int8 rows load half the bytes and decode on the GPU at no modelled cost. A prompt whose
reused share is below `min_share` gets the normal prefill, as the server's break-even fallback
does (the server fetches a request's disk chunks before that decision; the model charges
no transfer to a request that falls back). `fifo_ttfts` adds the wait of one FIFO server under
Poisson arrivals.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np


class Load(NamedTuple):
    """One reused chunk: its tokens, the bytes read, and where from ("host" or "disk")."""

    tokens: int
    nbytes: int
    tier: str


@dataclass(frozen=True)
class FusedPrefillTimes:
    """Measured prefill seconds at `lengths` prompt tokens: `full_s` the normal prefill,
    `fused_s` a fused one reusing every document token at the measured ratio."""

    lengths: tuple[int, ...]
    full_s: tuple[float, ...]
    fused_s: tuple[float, ...]
    h2d_bytes_per_s: float
    disk_bytes_per_s: float
    min_share: float = 0.0

    def __post_init__(self) -> None:
        if not (len(self.lengths) == len(self.full_s) == len(self.fused_s) >= 2):
            raise ValueError("lengths, full_s and fused_s need two or more points each")
        if list(self.lengths) != sorted(set(self.lengths)) or self.lengths[0] <= 0:
            raise ValueError(f"lengths must be positive and increasing, got {self.lengths}")
        if min(self.h2d_bytes_per_s, self.disk_bytes_per_s) <= 0:
            raise ValueError("transfer rates must be positive")
        if not 0.0 <= self.min_share <= 1.0:
            raise ValueError(f"min_share must be in [0, 1], got {self.min_share}")

    @classmethod
    def from_gpu_benchmark(
        cls,
        report: dict[str, Any],
        model: str,
        method: str,
        backend: str,
        disk_bytes_per_s: float,
        min_share: float = 0.0,
    ) -> FusedPrefillTimes:
        """From a `fusion_gpu` report: `model`'s rows, `method` ("selector@ratio") on
        `backend`, and the host-to-GPU rate measured with that selector's host-resident chunks
        (the median over the lengths that measured it)."""
        (found,) = [m for m in report["models"] if m["name"] == model]
        rows = sorted(found["results"], key=lambda row: row["tokens"])
        selector = method.split("@")[0]
        h2d = [
            loads[selector]["h2d_gb_per_s"]
            for row in rows
            if selector in (loads := row.get("host_loads_by_selector") or {})
        ]
        if not h2d:
            raise ValueError(f"{model}: no host-to-GPU rate in the report")
        return cls(
            lengths=tuple(row["tokens"] for row in rows),
            full_s=tuple(row["full"][backend]["ttft_s"] for row in rows),
            fused_s=tuple(row["fused"][method][backend]["ttft_s"] for row in rows),
            h2d_bytes_per_s=float(np.median(h2d)) * 1e9,
            disk_bytes_per_s=disk_bytes_per_s,
            min_share=min_share,
        )

    def full(self, tokens: int) -> float:
        return _interpolate(self.lengths, self.full_s, tokens)

    def fused(self, tokens: int) -> float:
        return _interpolate(self.lengths, self.fused_s, tokens)

    def ttft(self, prompt_tokens: int, loads: Sequence[Load]) -> float:
        """Service seconds of one request (no queue)."""
        reused = min(prompt_tokens, sum(load.tokens for load in loads))
        share = reused / prompt_tokens if prompt_tokens else 0.0
        if share == 0.0 or share < self.min_share:
            return self.full(prompt_tokens)
        compute = (1 - share) * self.full(prompt_tokens) + share * self.fused(prompt_tokens)
        moved = sum(load.nbytes for load in loads)
        from_disk = sum(load.nbytes for load in loads if load.tier == "disk")
        return compute + moved / self.h2d_bytes_per_s + from_disk / self.disk_bytes_per_s


def _interpolate(lengths: Sequence[int], seconds: Sequence[float], tokens: int) -> float:
    if tokens <= lengths[0]:
        return seconds[0] * tokens / lengths[0]
    if tokens >= lengths[-1]:
        slope = (seconds[-1] - seconds[-2]) / (lengths[-1] - lengths[-2])
        return seconds[-1] + slope * (tokens - lengths[-1])
    return float(np.interp(tokens, lengths, seconds))


def fifo_ttfts(service_s: Sequence[float], rate_per_s: float, seed: int = 0) -> list[float]:
    """TTFT (wait + service) of each request at one FIFO server, arrivals Poisson at
    `rate_per_s` (the same arrival times for every list of the same length and seed)."""
    if rate_per_s <= 0 or math.isinf(rate_per_s):
        raise ValueError(f"rate_per_s must be positive and finite, got {rate_per_s}")
    rng = random.Random(seed)
    wait, ttfts = 0.0, []
    previous_service = 0.0
    for index, service in enumerate(service_s):
        if index:  # Lindley: the wait behind the request before
            wait = max(0.0, wait + previous_service - rng.expovariate(rate_per_s))
        ttfts.append(wait + service)
        previous_service = service
    return ttfts
