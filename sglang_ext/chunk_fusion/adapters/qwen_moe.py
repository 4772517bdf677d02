"""Qwen2-MoE and Qwen3-MoE: a sparse MoE block as every layer's `mlp`.

Qwen3-MoE's block is called as SGLang calls it (router, TopK, experts) and its attention norms
q and k per head as Qwen3's. Qwen2-MoE's block adds a shared expert gated by a sigmoid; on a
CPU without AMX SGLang's block does that in a Triton kernel (`fused_gate_sigmoid_mul_add`), so
the adapter composes the same sum from the block's own modules:
experts(x, topk(x, gate(x))) + sigmoid(shared_expert_gate(x)) * shared_expert(x)."""

from __future__ import annotations

from typing import Any

import torch

from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.decoder import SGLangDecoderAdapter
from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.qwen3 import Qwen3Adapter
from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.registry import register


@register("Qwen3MoeForCausalLM")
class Qwen3MoeAdapter(Qwen3Adapter):
    """Qwen3's attention; the layer's `mlp` is SGLang's sparse block, called as SGLang calls it."""


@register("Qwen2MoeForCausalLM")
class Qwen2MoeAdapter(SGLangDecoderAdapter):
    def mlp(self, block: Any, x: torch.Tensor) -> torch.Tensor:
        moe = block.mlp
        if not hasattr(moe, "experts"):  # a dense layer (mlp_only_layers)
            return super().mlp(block, x)
        router_logits = _first(moe.gate(x))
        out = self.reduced(moe.experts(x, moe.topk(x, router_logits)), moe.experts)
        if getattr(moe, "shared_expert", None) is not None:
            shared = self.reduced(moe.shared_expert(x), moe.shared_expert.down_proj)
            if getattr(moe, "shared_expert_gate", None) is not None:
                # The gate is replicated: each rank's sigmoid is the same.
                shared = torch.sigmoid(_first(moe.shared_expert_gate(x))) * shared
            out = out + shared
        return out


def _first(output: Any) -> torch.Tensor:
    # SGLang's linear layers return (output, bias); a plain nn.Linear the tensor.
    return output[0] if isinstance(output, tuple) else output
