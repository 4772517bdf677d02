"""Qwen2 / Qwen2.5: Llama's layout with q/k/v biases (inside SGLang's qkv_proj).

SGLang runs `use_sliding_window` as full attention; dual-chunk RoPE is not a rotation the core
can undo and is refused by the RoPE spec."""

from __future__ import annotations

from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.decoder import SGLangDecoderAdapter
from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.registry import register


@register("Qwen2ForCausalLM")
class Qwen2Adapter(SGLangDecoderAdapter):
    """Qwen2's layout is the shared decoder's."""
