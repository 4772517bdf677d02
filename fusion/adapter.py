"""The small model interface the fusion executor drives, one layer at a time.

An adapter exposes a decoder-only RoPE model as four steps per layer so the executor can choose,
per layer, which tokens are computed. Write one per engine: `adapters/hf.py` for transformers;
an SGLang adapter can wrap SGLang's own modules the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

from sglang_hicache_ext.fusion.chunk import ModelShape
from sglang_hicache_ext.fusion.rope import RopeSpec, apply_rope


class AttentionInputs(NamedTuple):
    """Pre-RoPE projections of one layer: q [n, Hq, D], k and v [n, Hkv, D]."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor


class ModelAdapter(ABC):
    """A RoPE decoder split at the attention op. Hidden states are [n, hidden_size]."""

    shape: ModelShape
    rope_spec: RopeSpec
    attn_scale: float
    device: torch.device  # where activations and KV live
    dtype: torch.dtype  # activation / KV dtype

    @abstractmethod
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [n, hidden] (the residual stream entering layer 0)."""

    @abstractmethod
    def attention_inputs(self, layer: int, hidden: torch.Tensor) -> AttentionInputs:
        """Input norm and q/k/v projections of `layer`, before RoPE."""

    @abstractmethod
    def attention_output(
        self, layer: int, hidden: torch.Tensor, attn: torch.Tensor
    ) -> torch.Tensor:
        """Finish `layer`: o_proj of `attn` [n, Hq, D], residual add onto `hidden`, norm, MLP."""

    @abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: float32 logits [n, vocab]."""

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Apply RoPE to q or k [n, H, D] at `positions`; override to use an engine's kernel."""
        return apply_rope(x, positions, self.rope_spec)
