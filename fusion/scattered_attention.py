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
tokens, r = 0.15: one masked call over every key took 2.0 ms a layer, half of it on pairs that
the mask then throws away).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention

# Queries per SDPA call: small enough that a block's keys end near its queries, large enough
# that each call keeps both cores busy over the heads and the calls stay few.
QUERY_BLOCK = 128
# On a GPU: this many blocks (computing (1 + 1/n) / 2 of the query x key pairs), of at least
# GPU_MIN_BLOCK queries (the last one excepted), below which a call no longer fills an H200.
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
        query_positions if host_positions is None else host_positions, gpu=gpu, num_keys=k.shape[2]
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
    positions: torch.Tensor, *, gpu: bool, num_keys: int | None = None
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


# The positions a mask was built for: a copy (CPU, compared by value) or a reference (GPU,
# compared by identity).
PositionsKey = torch.Tensor | weakref.ref[torch.Tensor]


@dataclass(eq=False)
class _Entry:
    queries: PositionsKey
    keys: PositionsKey
    mask: torch.Tensor
    finalizer: weakref.finalize | None = None


class _RecentMasks:
    """The additive causal-by-position masks of the last few pairs of positions seen: one per
    request of a batched prefill, whose requests take turns at every layer.

    On the CPU an entry keeps copies of its positions and a hit compares them (a few thousand
    integers, no pass over the mask), so a mask is never used for other positions. On a GPU it
    keeps references and a hit is the same tensors: comparing values would read the GPU back at
    every layer. A caller on a GPU must therefore never change a positions tensor in place (the
    executor builds them per request; RoPE's tables rely on the same). An entry is dropped when
    its query positions are freed (the end of a request) or when newer ones push it out, so a
    long prompt's mask does not outlive it."""

    SIZE = 4

    def __init__(self) -> None:
        # Reentrant: a finalizer (`_drop`) can run inside `get`, when an allocation there
        # triggers the cycle collector.
        self._lock = threading.RLock()
        self._entries: list[_Entry] = []

    def get(
        self, query_positions: torch.Tensor, key_positions: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        with self._lock:
            for entry in self._entries:
                if (
                    entry.mask.dtype == dtype
                    and entry.mask.device == query_positions.device
                    and _same(entry.queries, query_positions)
                    and _same(entry.keys, key_positions)
                ):
                    return entry.mask
            hidden = key_positions.unsqueeze(0) > query_positions.unsqueeze(1)
            mask = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
            mask.masked_fill_(hidden, float("-inf"))
            if query_positions.is_cuda:
                entry = _Entry(weakref.ref(query_positions), weakref.ref(key_positions), mask)
            else:
                entry = _Entry(query_positions.clone(), key_positions.clone(), mask)
            entry.finalizer = weakref.finalize(query_positions, self._drop, entry)
            self._entries.insert(0, entry)
            for old in self._entries[self.SIZE :]:
                assert old.finalizer is not None
                old.finalizer.detach()  # its mask goes now, not with its positions
            del self._entries[self.SIZE :]
            return mask

    def _drop(self, entry: _Entry) -> None:
        with self._lock:
            if entry in self._entries:
                self._entries.remove(entry)

    def __len__(self) -> int:
        return len(self._entries)


def _same(kept: PositionsKey, positions: torch.Tensor) -> bool:
    if isinstance(kept, weakref.ref):
        return kept() is positions
    return kept.shape == positions.shape and bool(torch.equal(kept, positions))


_mask_cache = _RecentMasks()
