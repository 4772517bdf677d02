"""A precomputed chunk: its tokens, pre-RoPE K and V per layer, and frequency scores.

`StoredChunk` is what the executor needs of a chunk: its tokens and scores up front, and the
stored K/V rows of a layer when that layer runs. `PrecomputedChunk` holds them in memory; a
chunk on a slower tier can read them on demand (only the rows asked for), which the executor's
layer loader overlaps with the compute of the previous layer.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class ModelShape:
    """The KV geometry a chunk must match to be reused by a model."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_q_heads, self.num_kv_heads, self.head_dim) <= 0:
            raise ValueError(f"model shape fields must be positive: {self}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError("num_q_heads must be a multiple of num_kv_heads")


class StoredChunk(Protocol):
    """A chunk as the executor reads it: tokens and scores at once, K/V rows by layer."""

    @property
    def token_ids(self) -> tuple[int, ...]: ...
    @property
    def freq_scores(self) -> torch.Tensor: ...
    @property
    def alpha(self) -> float: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def nbytes(self) -> int:
        """Bytes of its rows and scores as its tier holds them (what a hit is counted as)."""
        ...

    @property
    def in_memory(self) -> bool:
        """False when `rows` reads from a slower tier (worth loading ahead of the compute)."""
        ...

    @property
    def index_device(self) -> torch.device:
        """Where `rows` indexes: row indices handed over there need no copy (an index copied
        between host and GPU at every layer stalls the GPU's queue)."""
        ...

    def check_compatible(self, shape: ModelShape) -> None: ...
    def rows(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-RoPE K and V of `rows` (sorted local token indices) at `layer`."""
        ...

    def slice(self, start: int, end: int) -> StoredChunk:
        """Tokens [start, end) of the chunk (no rows read)."""
        ...


@dataclass(frozen=True, eq=False)
class PrecomputedChunk:
    """KV of a chunk prefilled alone at positions 0..n-1.

    keys[l] / values[l] are [n, num_kv_heads, head_dim]; keys are *before* RoPE so the chunk can
    be placed at any global position. freq_scores is [num_layers, n] (CacheTune, alpha below).
    """

    token_ids: tuple[int, ...]
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    freq_scores: torch.Tensor
    alpha: float = 0.5

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if n == 0:
            raise ValueError("a chunk must hold at least one token")
        if len(self.keys) == 0 or len(self.keys) != len(self.values):
            raise ValueError("keys and values must hold the same, non-zero number of layers")
        first = self.keys[0].shape
        if len(first) != 3 or first[0] != n:
            raise ValueError(f"keys must be [n={n}, heads, head_dim], got {tuple(first)}")
        for layer, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            if k.shape != first or v.shape[:2] != first[:2]:
                raise ValueError(f"layer {layer}: K {tuple(k.shape)} / V {tuple(v.shape)} mismatch")
        if tuple(self.freq_scores.shape) != (len(self.keys), n):
            raise ValueError(
                f"freq_scores must be [{len(self.keys)}, {n}], got {tuple(self.freq_scores.shape)}"
            )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored tensors (what a byte-capacity tier accounts for)."""
        tensors = (*self.keys, *self.values, self.freq_scores)
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def content_hash(self) -> str:
        """Stable key of the token sequence (what the chunk index and tiers store it under)."""
        return chunk_hash(self.token_ids)

    @property
    def in_memory(self) -> bool:
        return True

    @property
    def index_device(self) -> torch.device:
        return self.keys[0].device

    def check_compatible(self, shape: ModelShape) -> None:
        """Raise ValueError unless this chunk's KV geometry matches `shape`."""
        _, heads, dim = self.keys[0].shape
        check_geometry(self.num_layers, heads, dim, shape)

    def rows(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.keys[layer], self.values[layer]
        return k[rows.to(k.device)], v[rows.to(v.device)]

    def slice(self, start: int, end: int) -> PrecomputedChunk:
        """Rows [start, end) (views of the tensors; the chunk itself when whole)."""
        if (start, end) == (0, self.num_tokens):
            return self
        return PrecomputedChunk(
            token_ids=self.token_ids[start:end],
            keys=tuple(k[start:end] for k in self.keys),
            values=tuple(v[start:end] for v in self.values),
            freq_scores=self.freq_scores[:, start:end],
            alpha=self.alpha,
        )

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> PrecomputedChunk:
        """A copy with K/V on `device` (and `dtype`); scores stay float32."""
        return PrecomputedChunk(
            token_ids=self.token_ids,
            keys=tuple(k.to(device=device, dtype=dtype) for k in self.keys),
            values=tuple(v.to(device=device, dtype=dtype) for v in self.values),
            freq_scores=self.freq_scores.to(device),
            alpha=self.alpha,
        )


def check_geometry(num_layers: int, kv_heads: int, head_dim: int, shape: ModelShape) -> None:
    """Raise ValueError unless a chunk's KV geometry matches the model's."""
    if (num_layers, kv_heads, head_dim) != (shape.num_layers, shape.num_kv_heads, shape.head_dim):
        raise ValueError(
            f"chunk KV (layers={num_layers}, kv_heads={kv_heads}, head_dim={head_dim}) does not "
            f"match the model (layers={shape.num_layers}, kv_heads={shape.num_kv_heads}, "
            f"head_dim={shape.head_dim})"
        )


def chunk_hash(token_ids: tuple[int, ...] | list[int]) -> str:
    # Little-endian uint32 per token; numpy refuses ids outside uint32 (OverflowError).
    data = np.asarray(token_ids, dtype="<u4").tobytes()
    return hashlib.sha256(data).hexdigest()
