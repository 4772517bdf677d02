"""The small model interface the fusion executor drives, one layer at a time.

An adapter exposes a decoder-only RoPE model as four steps per layer so the executor can choose,
per layer, which tokens are computed. Write one per engine: `adapters/hf.py` for transformers;
an SGLang adapter can wrap SGLang's own modules the same way. What a model family differs in
that the executor must honour (a layer's RoPE, its sliding window, its score softcap) is part of
the contract as `LayerAttention`, never a branch on the family inside the executor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from sglang_hicache_ext.fusion.chunk import ModelShape
from sglang_hicache_ext.fusion.rope import RopeSpec, apply_rope


class AttentionInputs(NamedTuple):
    """Pre-RoPE projections of one layer: q [n, Hq, D], k and v [n, Hkv, D]."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor


@dataclass(frozen=True, eq=False)
class LayerAttention:
    """How one layer's attention scores keys.

    rope: the rotation of its queries and keys. sliding_window: a query at position p sees the
    keys at p - sliding_window < k <= p (None: every earlier key), transformers' convention.
    logit_cap: scores become cap * tanh(score / cap) before the softmax (0: none).
    """

    rope: RopeSpec
    sliding_window: int | None = None
    logit_cap: float = 0.0

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.logit_cap < 0:
            raise ValueError(f"logit_cap must be >= 0, got {self.logit_cap}")


def uniform_layers(rope: RopeSpec, num_layers: int) -> tuple[LayerAttention, ...]:
    """Every layer full causal attention with one RoPE (Llama, Qwen2, ...)."""
    plain = LayerAttention(rope)
    return (plain,) * num_layers


def layers_from(
    ropes: Sequence[RopeSpec], windows: Sequence[int | None], logit_cap: float = 0.0
) -> tuple[LayerAttention, ...]:
    """Per-layer attention from per-layer RoPE specs and windows (one object per distinct kind)."""
    if len(ropes) != len(windows):
        raise ValueError(f"{len(ropes)} RoPE specs for {len(windows)} layers")
    kinds: dict[tuple[int, int | None], LayerAttention] = {}
    out = []
    for rope, window in zip(ropes, windows, strict=True):
        key = (id(rope), window)
        if key not in kinds:
            kinds[key] = LayerAttention(rope, window, logit_cap)
        out.append(kinds[key])
    return tuple(out)


class ModelAdapter(ABC):
    """A RoPE decoder split at the attention op. Hidden states are [n, hidden_size].

    `layers[l]` says how layer l attends; `rope_spec` is layer 0's rotation (the one of every
    layer for most families). The executor rotates through `rotate` and attends as `layers`
    says, so an adapter whose modules reproduce its engine's forward gives that forward's
    output at ratio 1.
    """

    shape: ModelShape
    rope_spec: RopeSpec
    layers: tuple[LayerAttention, ...]
    attn_scale: float
    device: torch.device  # where activations and KV live
    dtype: torch.dtype  # activation / KV dtype

    @abstractmethod
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [n, hidden] (the residual stream entering layer 0)."""

    @abstractmethod
    def attention_inputs(self, layer: int, hidden: torch.Tensor) -> AttentionInputs:
        """Input norm and q/k/v projections of `layer` (and per-head q/k norms where the
        family has them), before RoPE."""

    @abstractmethod
    def attention_output(
        self, layer: int, hidden: torch.Tensor, attn: torch.Tensor
    ) -> torch.Tensor:
        """Finish `layer`: o_proj of `attn` [n, Hq, D], residual add onto `hidden`, norm, MLP."""

    @abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head (and final softcap where the family has one): float32
        logits [n, vocab]."""

    def combine_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """A selector's scores [N_chunk] from the heads this process holds -> the scores of
        every head. Identity for a model in one process; a tensor-parallel adapter sums the
        ranks' scores, so every rank ranks the same totals and recomputes the same tokens.
        Called once per selection, in the same order on every rank."""
        return scores

    def rope_specs(self) -> tuple[RopeSpec, ...]:
        """Each layer's rotation: what a stored chunk's keys are rotated back with."""
        return tuple(layer.rope for layer in self.layers)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
        """Apply `layer`'s RoPE to q or k [n, H, D] at `positions`; override to use an
        engine's kernel."""
        return apply_rope(x, positions, self.layers[layer].rope)
