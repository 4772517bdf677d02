"""Gemma 2 and Gemma 3 (text): sandwich norms, embedding scale, logits from the embedding.

Each layer norms attention's output and the MLP's input and output (`post_attention_layernorm`,
`pre_feedforward_layernorm`, `post_feedforward_layernorm`, all (1 + w) RMSNorms). Gemma 2 scales
the embedding by sqrt(hidden) in the model's forward (Gemma 3's embedding module does it
itself), caps attention scores and the final logits; its even layers, and five of Gemma 3's six,
attend inside a sliding window, read from RadixAttention. Gemma 3 norms q and k per head and
rotates sliding layers with their own RoPE base (`fusion.rope.layer_rope_specs`)."""

from __future__ import annotations

from typing import Any

import torch

from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.decoder import (
    PerHeadQKNorm,
    SGLangDecoderAdapter,
)
from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.registry import register


class _SandwichAdapter(SGLangDecoderAdapter):
    @property
    def lm_head(self) -> Any:
        return self._model.model.embed_tokens

    def attention_output(
        self, layer: int, hidden: torch.Tensor, attn: torch.Tensor
    ) -> torch.Tensor:
        block = self._layers[layer]
        o_proj = block.self_attn.o_proj
        out, _ = o_proj(attn.reshape(attn.shape[0], -1))
        # The norms act on the whole sum: the ranks' parts are summed first.
        hidden = hidden + block.post_attention_layernorm(self.reduced(out, o_proj))
        mlp = self.mlp(block, block.pre_feedforward_layernorm(hidden))
        return hidden + block.post_feedforward_layernorm(mlp)


@register("Gemma2ForCausalLM")
class Gemma2Adapter(_SandwichAdapter):
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        hidden = self._model.model.embed_tokens(token_ids)
        # As SGLang's Gemma2Model: the scale in the activations' dtype, not float32.
        return hidden * torch.tensor(self.hidden_size**0.5, dtype=hidden.dtype)


@register("Gemma3ForCausalLM")
class Gemma3Adapter(PerHeadQKNorm, _SandwichAdapter):
    """Gemma 2's layout with per-head q/k norms; its embedding module scales by sqrt(hidden)."""
