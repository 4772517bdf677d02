"""A slice of a production trace scaled down to a small model, for fidelity checks.

Lengths are divided by `length_scale` (the trace's 512-token blocks become `block_tokens`-token
blocks: 16 at the default scale of 32, one SGLang page), arrival gaps are multiplied by
`time_scale` (a CPU server is far slower than the GPUs the trace came from). Each block id maps to
fixed random token ids, so requests that share block ids share real token prefixes and hit the
real server's prefix caches exactly where the simulator's block caches hit.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from sglang_hicache_ext.tuning.trace import SimRequest


@dataclass(frozen=True)
class SliceSpec:
    first: int = 0  # index of the first kept request of the (arrival-sorted) trace
    count: int = 240
    # Keep one conversation in `conversation_stride` (by the hash of its first block after the
    # shared one): thins the load while keeping every turn of the kept conversations.
    conversation_stride: int = 1
    length_scale: float = 32.0
    time_scale: float = 5.0
    block_tokens: int = 16  # tokens of one scaled block (trace block 512 / length_scale)
    max_input_tokens: int = 6000  # what the model's context and the server's pool allow
    token_low: int = 1000  # token ids are drawn from [token_low, token_high): no special tokens
    token_high: int = 40_000

    def __post_init__(self) -> None:
        if self.count < 1 or self.first < 0 or self.conversation_stride < 1:
            raise ValueError("need first >= 0, count >= 1 and conversation_stride >= 1")
        if self.length_scale <= 0 or self.time_scale <= 0:
            raise ValueError("scales must be > 0")
        if self.block_tokens < 1 or self.max_input_tokens < self.block_tokens:
            raise ValueError("need 1 <= block_tokens <= max_input_tokens")
        if not 0 <= self.token_low < self.token_high:
            raise ValueError("need 0 <= token_low < token_high")


class ScaledRequest(NamedTuple):
    arrival_s: float  # from the slice's first arrival
    input_ids: tuple[int, ...]
    output_tokens: int
    blocks: tuple[str, ...]

    def as_sim_request(self) -> SimRequest:
        return SimRequest(self.arrival_s, len(self.input_ids), self.output_tokens, self.blocks)


def scale_slice(requests: Sequence[SimRequest], spec: SliceSpec) -> list[ScaledRequest]:
    """`spec.count` requests from `spec.first`, with scaled lengths, times and real token ids."""
    kept = [r for r in requests if conversation_of(r) % spec.conversation_stride == 0]
    chosen = kept[spec.first : spec.first + spec.count]
    if not chosen:
        raise ValueError(f"the trace has no request at index {spec.first}")
    start = chosen[0].arrival_s
    cache: dict[str, tuple[int, ...]] = {}
    scaled = []
    for request in chosen:
        tokens = min(spec.max_input_tokens, max(1, round(request.input_tokens / spec.length_scale)))
        blocks = request.blocks[: math.ceil(tokens / spec.block_tokens)]
        ids = [t for block in blocks for t in _block_tokens(block, spec, cache)][:tokens]
        scaled.append(
            ScaledRequest(
                arrival_s=(request.arrival_s - start) * spec.time_scale,
                input_ids=tuple(ids),
                output_tokens=max(1, round(request.output_tokens / spec.length_scale)),
                blocks=tuple(blocks),
            )
        )
    return scaled


def conversation_of(request: SimRequest) -> int:
    """Stable id of a request's conversation: its first block after the shared one."""
    return zlib.crc32(request.blocks[min(1, len(request.blocks) - 1)].encode())


def _block_tokens(
    block: str, spec: SliceSpec, cache: dict[str, tuple[int, ...]]
) -> tuple[int, ...]:
    if block not in cache:
        rng = np.random.default_rng(zlib.crc32(block.encode()))
        ids = rng.integers(spec.token_low, spec.token_high, size=spec.block_tokens)
        cache[block] = tuple(int(t) for t in ids)
    return cache[block]
