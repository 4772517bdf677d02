"""A chunk as the tiers take it and give it back, without importing fusion: what a stored chunk
is made of (`ChunkLike`), a chunk read back (`ChunkTensors`), and a tensor's bytes as stored
files hold them."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch


class ChunkLike(Protocol):
    """What a stored chunk is made of (`fusion.chunk.PrecomputedChunk` is one)."""

    @property
    def token_ids(self) -> tuple[int, ...]: ...
    @property
    def keys(self) -> tuple[torch.Tensor, ...]: ...
    @property
    def values(self) -> tuple[torch.Tensor, ...]: ...
    @property
    def freq_scores(self) -> torch.Tensor: ...
    @property
    def alpha(self) -> float: ...


class ChunkTensors(NamedTuple):
    """A chunk read back: the fields of `fusion.chunk.PrecomputedChunk`, in its order (storage
    does not import fusion; `PrecomputedChunk(*tensors)` rebuilds one)."""

    token_ids: tuple[int, ...]
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    freq_scores: torch.Tensor
    alpha: float


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The raw bytes of a tensor (CPU, contiguous), as stored files hold them."""
    # reshape(-1): one stride of 1 even where a size-1 dimension kept an odd one
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
