"""Serving-time model of one instance: prefill and decode cost, memory limits.

Defaults describe an 8B-class dense model (Llama-3-8B: 32 layers, 8 KV heads of dim 128, fp16 KV)
on one H100-80GB-like GPU:
- prefill: ~16 GFLOP per token at ~480 TFLOP/s effective -> 33 us/token, plus attention that costs
  4 x 32 layers x 4096 = 0.5 MFLOP per (new token, context token) pair at ~300 TFLOP/s -> 1.7 ns;
- decode step: weights (16 GB) read at ~3.35 TB/s -> ~6 ms, plus each context token's KV
  (128 KiB) read -> 40 ns per token in the batch, plus a small per-sequence overhead;
- KV: 128 KiB per token, 512-token blocks (64 MiB); of the ~56 GB left after weights and
  activations, 320k tokens hold running requests and 100k tokens keep unreferenced cached prefixes;
- host -> GPU copies (DRAM hits, prefetched disk blocks) at 25 GB/s PCIe Gen5 effective;
- the disk tier's bandwidth comes from its disk type (`sglang_hicache_ext.tuning.cost`) unless `disk_bytes_s` is set.
Replace them with measured figures via `Profile.from_json` or `sglang_hicache_ext.tuning.sim.calibrate`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Profile:
    prefill_base_s: float = 0.004
    prefill_per_token_s: float = 3.3e-5
    prefill_attn_per_token_ctx_s: float = 1.7e-9
    decode_base_s: float = 0.006
    decode_per_seq_s: float = 5e-5
    decode_per_ctx_token_s: float = 4.0e-8
    kv_bytes_per_token: int = 32 * 2 * 8 * 128 * 2
    block_tokens: int = 512
    running_kv_tokens: int = 320_000
    prefix_cache_tokens: int = 100_000
    max_running_requests: int = 64
    max_prefill_tokens: int = 16_384
    host_to_gpu_bytes_s: float = 25e9
    disk_bytes_s: float = 0.0  # measured disk-tier bandwidth; 0: the disk type's table value

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"profile field {field.name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"profile field {field.name} must be finite and >= 0")
        positive = ("kv_bytes_per_token", "block_tokens", "max_running_requests")
        for name in (*positive, "max_prefill_tokens", "host_to_gpu_bytes_s", "running_kv_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"profile field {name} must be > 0")

    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.block_tokens

    def prefill_compute_s(self, new_tokens: int, cached_tokens: int) -> float:
        """Compute time of one request's prefill, without the per-batch overhead.

        Each new token attends to the cached prefix and, causally, to half the new tokens.
        """
        attention_pairs = new_tokens * (cached_tokens + new_tokens / 2)
        return (
            self.prefill_per_token_s * new_tokens
            + self.prefill_attn_per_token_ctx_s * attention_pairs
        )

    def decode_steps_s(self, batch: int, context_tokens: int, steps: int) -> float:
        """Time of `steps` decode steps of `batch` sequences holding `context_tokens` in total.

        The context grows by `batch` tokens per step, so the sum is an arithmetic series.
        """
        per_step = self.decode_base_s + self.decode_per_seq_s * batch
        first = per_step + self.decode_per_ctx_token_s * context_tokens
        growth = self.decode_per_ctx_token_s * batch
        return steps * first + growth * steps * (steps - 1) / 2

    def decode_steps_within(self, batch: int, context_tokens: int, budget_s: float) -> int:
        """How many whole decode steps fit in `budget_s` (at least one: a step is atomic)."""
        first = self.decode_base_s + self.decode_per_seq_s * batch
        first += self.decode_per_ctx_token_s * context_tokens
        growth = self.decode_per_ctx_token_s * batch
        if budget_s <= first:
            return 1
        if math.isinf(budget_s):
            return sys.maxsize
        if growth == 0:
            return max(1, int(budget_s // first))
        # Largest k with growth/2 k^2 + (first - growth/2) k <= budget.
        a, b = growth / 2, first - growth / 2
        k = int((-b + math.sqrt(b * b + 4 * a * budget_s)) / (2 * a))
        return max(1, k)

    @classmethod
    def from_json(cls, path: str | Path) -> Profile:
        """A profile from a JSON object of field overrides; unknown keys are refused."""
        values = json.loads(Path(path).read_text())
        return cls.from_mapping(values, source=str(path))

    @classmethod
    def from_mapping(cls, values: Any, source: str = "profile") -> Profile:
        if not isinstance(values, dict):
            raise ValueError(f"{source}: a profile must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{source}: unknown profile field(s) {', '.join(unknown)}")
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
