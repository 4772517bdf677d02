"""Qwen3: per-head RMSNorm of q and k after the projection, before RoPE.

A stored chunk's keys are the normed, unrotated ones (the pool's keys rotated back), so a
reused key is normed once, as SGLang's forward norms it."""

from __future__ import annotations

from typing import Any

import torch

from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.decoder import SGLangDecoderAdapter
from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.registry import register


def per_head_norms(
    attn: Any, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attn.q_norm` / `attn.k_norm` over [n, H, D] rows (SGLang norms each head's D dims)."""
    return attn.q_norm(q), attn.k_norm(k)


@register("Qwen3ForCausalLM")
class Qwen3Adapter(SGLangDecoderAdapter):
    def normed_qk(
        self, attn: Any, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return per_head_norms(attn, q, k)
