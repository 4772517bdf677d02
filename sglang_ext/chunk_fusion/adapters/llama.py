"""Llama (3.x RoPE scaling included) and the classes SGLang derives from it unchanged:
Mistral, Phi-3 (its fused checkpoint loads into Llama's modules), InternLM3.

SGLang runs Mistral's and Phi-3's `sliding_window` as full attention (no window reaches
RadixAttention), so the adapter reads none; Phi-3's longrope rotates by the batch's longest
position and is refused by the RoPE spec (`fusion.rope`)."""

from __future__ import annotations

from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.decoder import SGLangDecoderAdapter
from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.registry import register


@register("LlamaForCausalLM")
class LlamaAdapter(SGLangDecoderAdapter):
    """Llama's layout as it is: the shared decoder."""
