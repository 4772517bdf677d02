"""Attention of queries at scattered, ascending positions (a fused prefill's computed tokens).

Query block by block, each block over only the keys up to its last query's position: a masked
SDPA kernel cannot skip masked-out key blocks, so one call over every key computes every
query x key pair, while the blocks compute about the visible ones (a query at position p sees
p + 1 keys). The additive mask is built once per (query positions, key positions) pair and kept
for the next call: the fused prefill attends the same positions at every layer after the
selection, so the per-layer compare and fill passes over the [q, k] mask go away.

On a GPU the blocks are fewer and larger (a call must fill the chip), their bounds come from a
host copy of the positions and the mask is found by the positions tensors' identity: reading
positions back from the GPU would drain its queue at every layer (H200, Llama-3-8B shapes, 16K
tokens, r = 0.15: one masked call per layer spent 2.0 ms on the masked-out half of the pairs).
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.nn.functional import scaled_dot_product_attention

# Queries per SDPA call: small enough that a block's keys end near its queries, large enough
# that each call keeps both cores busy over the heads and the calls stay few.
QUERY_BLOCK = 128
# On a GPU: this many blocks (computing (1 + 1/n) / 2 of the query x key pairs), none smaller
# than GPU_MIN_BLOCK queries, below which a call no longer fills an H100/H200.
GPU_BLOCKS = 8
GPU_MIN_BLOCK = 256


def ascending(positions: torch.Tensor) -> bool:
    return positions.shape[0] < 2 or bool(torch.all(positions[1:] >= positions[:-1]))


def query_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scale: float | None,
    gqa: bool,
    host_positions: torch.Tensor | None = None,
    gpu_blocks: bool | None = None,
) -> torch.Tensor:
    """`q` [1, Hq, Lq, D] at ascending `query_positions` over `k`/`v` [1, Hkv, Lk, D] at key
    positions 0..Lk-1 (`key_positions`); a query sees the keys at or before its position.
    `host_positions`: the same positions in host memory (the blocks' bounds are read there).
    `gpu_blocks`: block as for a GPU (default: when `q` is on one)."""
    gpu = q.is_cuda if gpu_blocks is None else gpu_blocks
    mask = _mask_cache.get(query_positions, key_positions, q.dtype)
    outs = []
    for start, end, visible in block_bounds(
        query_positions if host_positions is None else host_positions, gpu, k.shape[2]
    ):
        block_mask = mask[start:end, :visible]
        if gpu:
            # The GPU's masked kernels want the mask's rows packed (a few MB a block).
            block_mask = block_mask.contiguous()
        outs.append(
            scaled_dot_product_attention(
                q[:, :, start:end],
                k[:, :, :visible],
                v[:, :, :visible],
                attn_mask=block_mask,
                scale=scale,
                enable_gqa=gqa,
            )
        )
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def block_bounds(
    positions: torch.Tensor, gpu: bool, num_keys: int | None = None
) -> list[tuple[int, int, int]]:
    """(first query, end query, keys seen) of each block of ascending `positions`; on a GPU
    the keys seen are rounded up to a multiple of 16 (at most `num_keys`), the alignment its
    kernels want: the keys past a block's last query are masked out anyway."""
    n = positions.shape[0]
    size = max(GPU_MIN_BLOCK, -(-n // GPU_BLOCKS)) if gpu else QUERY_BLOCK
    bounds = []
    for start in range(0, n, size):
        end = min(start + size, n)
        visible = int(positions[end - 1]) + 1
        if gpu and num_keys is not None:
            visible = min(num_keys, -(-visible // 16) * 16)
        bounds.append((start, end, visible))
    return bounds


# The positions a mask was built for: a copy (CPU, compared by value) or a reference (GPU).
Kept = torch.Tensor | weakref.ref[torch.Tensor]


class _LastMask:
    """The additive causal-by-position mask of the last pair of positions seen.

    Kept with copies of the positions it was built for: a hit compares them (a few thousand
    integers, no pass over the mask), so a mask is never used for other positions. Dropped when
    the caller's query positions tensor is freed (the end of a request), so a long prompt's mask
    does not outlive it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entry: tuple[Kept, Kept, torch.Tensor] | None = None

    def get(
        self, query_positions: torch.Tensor, key_positions: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        with self._lock:
            entry = self._entry
            if (
                entry is not None
                and entry[2].dtype == dtype
                and entry[2].device == query_positions.device
                and _same(entry[0], query_positions)
                and _same(entry[1], key_positions)
            ):
                return entry[2]
            hidden = key_positions.unsqueeze(0) > query_positions.unsqueeze(1)
            mask = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
            mask.masked_fill_(hidden, float("-inf"))
            if query_positions.is_cuda:
                # Found again by identity: comparing values would read the GPU back. The
                # executor builds position tensors per request and never changes them in
                # place (RoPE's tables rely on the same).
                entry = (weakref.ref(query_positions), weakref.ref(key_positions), mask)
            else:
                entry = (query_positions.clone(), key_positions.clone(), mask)
            self._entry = entry
            weakref.finalize(query_positions, self._drop, entry)
            return mask

    def _drop(self, entry: tuple[Kept, Kept, torch.Tensor]) -> None:
        with self._lock:
            if self._entry is entry:
                self._entry = None


def _same(kept: Kept, positions: torch.Tensor) -> bool:
    if isinstance(kept, weakref.ref):
        return kept() is positions
    return kept.shape == positions.shape and bool(torch.equal(kept, positions))


_mask_cache = _LastMask()
