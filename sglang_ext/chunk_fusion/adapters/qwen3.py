"""Qwen3: per-head RMSNorm of q and k after the projection, before RoPE (`PerHeadQKNorm`);
head_dim from the config, which may differ from hidden / heads."""

from __future__ import annotations

from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.decoder import (
    PerHeadQKNorm,
    SGLangDecoderAdapter,
)
from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.registry import register


@register("Qwen3ForCausalLM")
class Qwen3Adapter(PerHeadQKNorm, SGLangDecoderAdapter):
    """Qwen3's layout: the shared decoder with per-head q/k norms."""
