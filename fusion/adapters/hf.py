"""Adapter for transformers' decoder-only causal LMs, running the model's own modules.

Each step calls the HF submodules (embed_tokens, norms, q/k/v projections, per-head q/k norms,
o_proj, the MLP or sparse MoE block, lm_head) so a fully recomputed fused prefill equals the
model's own forward; only RoPE and attention come from the fusion core. The families differ in
modules the adapter finds on the model (a fused qkv_proj, q_norm / k_norm, Gemma's sandwich
norms) and in what the executor must know, which goes into the contract's `LayerAttention`
(each layer's RoPE, sliding window and score softcap).
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_hicache_ext.fusion.adapter import AttentionInputs, ModelAdapter, layers_from
from sglang_hicache_ext.fusion.chunk import ModelShape
from sglang_hicache_ext.fusion.rope import layer_rope_specs

SUPPORTED_MODEL_TYPES = frozenset(
    {
        "llama",
        "mistral",
        "phi3",
        "qwen2",
        "qwen3",
        "mixtral",
        "qwen2_moe",
        "qwen3_moe",
        "gemma2",
        "gemma3_text",
    }
)


class HFCausalLMAdapter(ModelAdapter):
    """Wraps a transformers causal LM of a supported family (any dtype, any device).

    Families whose score softcap (Gemma 2) only transformers' eager attention applies should be
    loaded with `attn_implementation="eager"` for their own forward to be the reference."""

    def __init__(self, model: Any) -> None:
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model type {config.model_type!r}; "
                f"expected one of {sorted(SUPPORTED_MODEL_TYPES)}"
            )
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
        ropes = layer_rope_specs(config)
        windows = [_window(config, block.self_attn) for block in self._layers]
        self.layers = layers_from(ropes, windows, _cap(config, "attn_logit_softcapping"))
        self.rope_spec = ropes[0]
        self.attn_scale = float(self._layers[0].self_attn.scaling)
        self._final_cap = _cap(config, "final_logit_softcapping")
        self._sandwich = hasattr(self._layers[0], "pre_feedforward_layernorm")
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
        # Gemma's embedding module scales by sqrt(hidden) itself.
        return self._decoder.embed_tokens(token_ids)

    def attention_inputs(self, layer: int, hidden: torch.Tensor) -> AttentionInputs:
        block = self._layers[layer]
        attn = block.self_attn
        normed = block.input_layernorm(hidden)
        n, dim = hidden.shape[0], self.shape.head_dim
        if hasattr(attn, "qkv_proj"):  # Phi-3: one fused projection, [q | k | v]
            q_size, kv_size = self.shape.num_q_heads * dim, self.shape.num_kv_heads * dim
            q, k, v = attn.qkv_proj(normed).split([q_size, kv_size, kv_size], dim=-1)
        else:
            q, k, v = attn.q_proj(normed), attn.k_proj(normed), attn.v_proj(normed)
        q, k, v = q.view(n, -1, dim), k.view(n, -1, dim), v.view(n, -1, dim)
        if hasattr(attn, "q_norm"):  # Qwen3, Gemma 3: per-head norms before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        return AttentionInputs(q, k, v)

    def attention_output(
        self, layer: int, hidden: torch.Tensor, attn: torch.Tensor
    ) -> torch.Tensor:
        block = self._layers[layer]
        out = block.self_attn.o_proj(attn.reshape(attn.shape[0], -1))
        if self._sandwich:  # Gemma 2 / 3: norms after attention and around the MLP
            hidden = hidden + block.post_attention_layernorm(out)
            mlp = _mlp(block.mlp, block.pre_feedforward_layernorm(hidden))
            return hidden + block.post_feedforward_layernorm(mlp)
        hidden = hidden + out
        return hidden + _mlp(block.mlp, block.post_attention_layernorm(hidden))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._model.lm_head(self._decoder.norm(hidden)).float()
        if self._final_cap:
            logits = torch.tanh(logits / self._final_cap) * self._final_cap
        return logits


def _mlp(mlp: Any, x: torch.Tensor) -> torch.Tensor:
    # Sparse MoE blocks read [batch, seq, hidden]; dense MLPs take any leading dims.
    return mlp(x.unsqueeze(0)).squeeze(0)


def _window(config: Any, attn: Any) -> int | None:
    # Qwen2/3 and Gemma set it per layer on the module; Mistral, Mixtral, Phi-3 read the config.
    window = getattr(attn, "sliding_window", getattr(config, "sliding_window", None))
    return int(window) if window else None


def _cap(config: Any, name: str) -> float:
    return float(getattr(config, name, None) or 0.0)
