"""CPU attention of queries at scattered, ascending positions (a fused prefill's computed tokens).

Query block by block, each block over only the keys up to its last query's position: a masked
SDPA kernel cannot skip masked-out key blocks, so one call over every key computes every
query x key pair, while the blocks compute about the visible ones (a query at position p sees
p + 1 keys). The additive mask is built once per (query positions, key positions) pair and kept
for the next call: the fused prefill attends the same positions at every layer after the
selection, so the per-layer compare and fill passes over the [q, k] mask go away.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.nn.functional import scaled_dot_product_attention

# Queries per SDPA call: small enough that a block's keys end near its queries, large enough
# that each call keeps both cores busy over the heads and the calls stay few.
QUERY_BLOCK = 128


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
) -> torch.Tensor:
    """`q` [1, Hq, Lq, D] at ascending `query_positions` over `k`/`v` [1, Hkv, Lk, D] at key
    positions 0..Lk-1 (`key_positions`); a query sees the keys at or before its position."""
    mask = _mask_cache.get(query_positions, key_positions, q.dtype)
    outs = []
    for start in range(0, q.shape[2], QUERY_BLOCK):
        end = min(start + QUERY_BLOCK, q.shape[2])
        visible = int(query_positions[end - 1]) + 1
        outs.append(
            scaled_dot_product_attention(
                q[:, :, start:end],
                k[:, :, :visible],
                v[:, :, :visible],
                attn_mask=mask[start:end, :visible],
                scale=scale,
                enable_gqa=gqa,
            )
        )
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


class _LastMask:
    """The additive causal-by-position mask of the last pair of positions seen.

    Kept with copies of the positions it was built for: a hit compares them (a few thousand
    integers, no pass over the mask), so a mask is never used for other positions. Dropped when
    the caller's query positions tensor is freed (the end of a request), so a long prompt's mask
    does not outlive it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entry: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

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
            entry = (query_positions.clone(), key_positions.clone(), mask)
            self._entry = entry
            weakref.finalize(query_positions, self._drop, entry)
            return mask

    def _drop(self, entry: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        with self._lock:
            if self._entry is entry:
                self._entry = None


def _same(kept: torch.Tensor, positions: torch.Tensor) -> bool:
    return kept.shape == positions.shape and bool(torch.equal(kept, positions))


_mask_cache = _LastMask()
