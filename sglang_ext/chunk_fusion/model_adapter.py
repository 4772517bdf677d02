"""SGLang's own Llama / Qwen2 modules seen through the fusion core's `ModelAdapter` (TP=1).

The fusion executor drives a model layer by layer, split at the attention op; this adapter calls
the SGLang modules' projections, norms and MLP directly, so the weights are the server's own.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_hicache_ext.fusion.adapter import AttentionInputs, ModelAdapter
from sglang_hicache_ext.fusion.chunk import ModelShape
from sglang_hicache_ext.fusion.rope import rope_spec_from_config


class SGLangModelAdapter(ModelAdapter):
    """SGLang's Llama / Qwen2 modules split at the attention op (TP=1)."""

    SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM")

    def __init__(self, model: Any, hf_config: Any) -> None:
        if type(model).__name__ not in self.SUPPORTED:
            raise ValueError(
                f"fusion has no adapter for {type(model).__name__}; supported: {', '.join(self.SUPPORTED)}"
            )
        self._model = model
        self._layers = model.model.layers
        attn = self._layers[0].self_attn
        self.shape = ModelShape(
            num_layers=len(self._layers),
            num_q_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
        )
        self.rope_spec = rope_spec_from_config(hf_config)
        self.attn_scale = float(attn.scaling)
        weight = model.model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.hidden_size = int(weight.shape[1])

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._model.model.embed_tokens(token_ids)

    def attention_inputs(self, layer: int, hidden: torch.Tensor) -> AttentionInputs:
        block = self._layers[layer]
        attn = block.self_attn
        qkv, _ = attn.qkv_proj(block.input_layernorm(hidden))
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        n, dim = hidden.shape[0], self.shape.head_dim
        return AttentionInputs(q.view(n, -1, dim), k.view(n, -1, dim), v.view(n, -1, dim))

    def attention_output(
        self, layer: int, hidden: torch.Tensor, attn: torch.Tensor
    ) -> torch.Tensor:
        block = self._layers[layer]
        out, _ = block.self_attn.o_proj(attn.reshape(attn.shape[0], -1))
        hidden = hidden + out
        return hidden + block.mlp(block.post_attention_layernorm(hidden))

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's final norm: what its forward hands the logits processor."""
        return self._model.model.norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.final_norm(hidden) @ self._model.lm_head.weight.t()).float()
