"""Adapter for transformers' Llama and Qwen2 causal LMs, running the model's own modules.

Each step calls the HF submodules (embed_tokens, input_layernorm, q/k/v_proj, o_proj,
post_attention_layernorm, mlp, norm, lm_head) so a fully recomputed fused prefill equals the
model's own forward; only RoPE and attention come from the fusion core.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_hicache_ext.fusion.adapter import AttentionInputs, ModelAdapter
from sglang_hicache_ext.fusion.chunk import ModelShape
from sglang_hicache_ext.fusion.rope import rope_spec_from_config

SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2"})


class HFCausalLMAdapter(ModelAdapter):
    """Wraps a `LlamaForCausalLM` / `Qwen2ForCausalLM` (any dtype, any device)."""

    def __init__(self, model: Any) -> None:
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model type {config.model_type!r}; "
                f"expected one of {sorted(SUPPORTED_MODEL_TYPES)}"
            )
        if getattr(config, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported by fusion")
        self._model = model
        self._decoder = model.model
        self._layers = model.model.layers
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.shape = ModelShape(
            num_layers=config.num_hidden_layers,
            num_q_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
        )
        self.rope_spec = rope_spec_from_config(config)
        self.attn_scale = float(self._layers[0].self_attn.scaling)
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype

    @classmethod
    def from_pretrained(
        cls, path: str, dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> HFCausalLMAdapter:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        return cls(model)

    @property
    def model(self) -> Any:
        return self._model

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._decoder.embed_tokens(token_ids)

    def attention_inputs(self, layer: int, hidden: torch.Tensor) -> AttentionInputs:
        block = self._layers[layer]
        attn = block.self_attn
        normed = block.input_layernorm(hidden)
        n, dim = hidden.shape[0], self.shape.head_dim
        return AttentionInputs(
            attn.q_proj(normed).view(n, -1, dim),
            attn.k_proj(normed).view(n, -1, dim),
            attn.v_proj(normed).view(n, -1, dim),
        )

    def attention_output(
        self, layer: int, hidden: torch.Tensor, attn: torch.Tensor
    ) -> torch.Tensor:
        block = self._layers[layer]
        hidden = hidden + block.self_attn.o_proj(attn.reshape(attn.shape[0], -1))
        return hidden + block.mlp(block.post_attention_layernorm(hidden))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._model.lm_head(self._decoder.norm(hidden)).float()
