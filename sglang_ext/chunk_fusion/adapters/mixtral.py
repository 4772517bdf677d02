"""Mixtral: Llama's attention, a sparse MoE block (`block_sparse_moe`) in place of the MLP.

The block is SGLang's own (router gate, TopK, FusedMoE: `moe_forward_native` on a CPU without
AMX), called on the normed rows as SGLang's layer calls it."""

from __future__ import annotations

from typing import Any

import torch

from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.decoder import SGLangDecoderAdapter
from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.registry import register


@register("MixtralForCausalLM")
class MixtralAdapter(SGLangDecoderAdapter):
    def mlp(self, block: Any, x: torch.Tensor) -> torch.Tensor:
        moe = block.block_sparse_moe
        return self.reduced(moe(x), moe.experts)
