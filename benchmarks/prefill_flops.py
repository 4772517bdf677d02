"""Arithmetic work of a normal and a fused prefill, counted in multiply-adds (MACs).

Per layer and computed token: the q/k/v projections, o_proj and the gated MLP; per query and
visible key (positions <= the query's): q.k and p.v over every query head. A fused prefill with a
check layer computes every token's q/k/v there (the selector scores them) and only the active
tokens' attention, o_proj and MLP; before it, every token fully. Norms, RoPE and softmax are
elementwise and left out; the LM head runs on the last token only, on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecoderShape:
    """The sizes that set a Llama-style decoder's prefill work."""

    num_layers: int
    hidden: int
    intermediate: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config: object) -> DecoderShape:
        heads = int(config.num_attention_heads)  # type: ignore[attr-defined]
        hidden = int(config.hidden_size)  # type: ignore[attr-defined]
        return cls(
            num_layers=int(config.num_hidden_layers),  # type: ignore[attr-defined]
            hidden=hidden,
            intermediate=int(config.intermediate_size),  # type: ignore[attr-defined]
            num_q_heads=heads,
            num_kv_heads=int(config.num_key_value_heads),  # type: ignore[attr-defined]
            head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
            vocab=int(config.vocab_size),  # type: ignore[attr-defined]
        )

    @property
    def qkv_macs(self) -> int:
        return self.hidden * (self.num_q_heads + 2 * self.num_kv_heads) * self.head_dim

    @property
    def rest_macs(self) -> int:
        """o_proj and the gated MLP of one token."""
        return self.num_q_heads * self.head_dim * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def pair_macs(self) -> int:
        """q.k and p.v of one query over one key, every query head."""
        return 2 * self.num_q_heads * self.head_dim


@dataclass(frozen=True)
class PrefillWork:
    """MACs of one prefill: dense (projections + MLP), attention (visible pairs), head, selector."""

    linear: float
    attention: float
    lm_head: float
    selection: float = 0.0

    @property
    def total(self) -> float:
        return self.linear + self.attention + self.lm_head + self.selection


def _visible_pairs(query_positions: torch.Tensor) -> float:
    """Keys a causal query at position p sees: p + 1."""
    return float((query_positions.double() + 1).sum())


def normal_work(shape: DecoderShape, num_tokens: int) -> PrefillWork:
    pairs = num_tokens * (num_tokens + 1) / 2
    return PrefillWork(
        linear=shape.num_layers * num_tokens * (shape.qkv_macs + shape.rest_macs),
        attention=shape.num_layers * pairs * shape.pair_macs,
        lm_head=shape.hidden * shape.vocab,
    )


def fused_work(
    shape: DecoderShape,
    num_tokens: int,
    active_positions: torch.Tensor,
    check_layer: int | None,
    question_tokens: int = 0,
    last_layer_outputs: int | None = None,
) -> PrefillWork:
    """Work of a fused prefill whose active (computed) tokens after the check layer are
    `active_positions`; `question_tokens` > 0 adds A3's question x key scores at the check layer.
    `last_layer_outputs`: the last layer's attention, o_proj and MLP run for that many (last)
    rows only, the ones whose output is read; every active row still gets its K/V there.
    None: every active row at every layer."""
    everything = torch.arange(num_tokens)
    full_layers = 0 if check_layer is None else check_layer
    sparse_layers = shape.num_layers - full_layers
    active = int(active_positions.numel())
    linear = full_layers * num_tokens * (shape.qkv_macs + shape.rest_macs)
    linear += sparse_layers * active * (shape.qkv_macs + shape.rest_macs)
    attention = full_layers * _visible_pairs(everything) + sparse_layers * _visible_pairs(
        active_positions
    )
    if last_layer_outputs is not None:
        unread = active_positions[: active - last_layer_outputs]
        linear -= int(unread.numel()) * shape.rest_macs
        attention -= _visible_pairs(unread)
    if check_layer is not None:
        # The check layer projects q/k/v of every token, not only the active ones.
        linear += (num_tokens - active) * shape.qkv_macs
    selection = question_tokens * num_tokens * shape.num_q_heads * shape.head_dim
    return PrefillWork(
        linear=linear,
        attention=attention * shape.pair_macs,
        lm_head=shape.hidden * shape.vocab,
        selection=selection,
    )
