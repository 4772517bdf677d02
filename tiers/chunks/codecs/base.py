"""The contract every chunk KV codec keeps: one layer's K and V in, a compressed layer out, and
back. Layers are compressed apart so that a tier can decompress them one at a time in its load
path, a layer ahead of the compute, as it reads dense rows today."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class CompressedLayer:
    """One layer of a chunk as a codec stores it: named tensors, and what decoding needs."""

    codec: str  # the spec that made it ("int8", "knorm:0.5", ...)
    num_tokens: int  # tokens of the chunk before any was dropped
    dtype: torch.dtype  # of the K/V it decodes to
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class DecodedLayer(NamedTuple):
    """K [kept, heads, key_dim] and V [kept, heads, value_dim], and which tokens they are
    (None: every token, in order)."""

    keys: torch.Tensor
    values: torch.Tensor
    kept: torch.Tensor | None


class KVCodec(ABC):
    """Compresses one layer of chunk KV; `decode(encode(k, v))` approximates (k, v)."""

    @property
    @abstractmethod
    def spec(self) -> str:
        """The codec's name as settings and requests write it ("int4", "snapkv:0.3")."""

    @abstractmethod
    def encode(
        self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None = None
    ) -> CompressedLayer:
        """Compress K/V [tokens, kv_heads, dim]; `queries` [probes, q_heads, key_dim] are the
        probe queries of scorers that need them (post-RoPE like the keys, or both pre-RoPE)."""

    @abstractmethod
    def decode(self, layer: CompressedLayer) -> DecodedLayer:
        """K/V back in the layer's dtype."""


def dense_nbytes(keys: torch.Tensor, values: torch.Tensor) -> int:
    return keys.numel() * keys.element_size() + values.numel() * values.element_size()
