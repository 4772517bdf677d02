"""Engine-agnostic fusion core: attention ops, RoPE recovery, selectors, executor.

Imports torch only, never sglang, so it runs and benchmarks where SGLang cannot be installed.
Model adapters live in `sglang_hicache_ext.fusion.adapters` (the transformers one imports transformers).
"""

from sglang_hicache_ext.fusion.adapter import AttentionInputs, LayerAttention, ModelAdapter
from sglang_hicache_ext.fusion.attention import (
    attend,
    flashinfer_available,
    gather_attend,
    position_causal_attention,
)
from sglang_hicache_ext.fusion.chunk import ModelShape, PrecomputedChunk, chunk_hash
from sglang_hicache_ext.fusion.decoding import GenerationResult, decode_step, generate_greedy
from sglang_hicache_ext.fusion.executor import FusionResult, KVCache, fused_prefill
from sglang_hicache_ext.fusion.frequency import frequency_scores, low_pass
from sglang_hicache_ext.fusion.precompute import precompute_chunk
from sglang_hicache_ext.fusion.request import ChunkSegment, RequestLayout, TextSegment, build_layout
from sglang_hicache_ext.fusion.rope import (
    RopeSpec,
    apply_rope,
    layer_rope_specs,
    rope_cos_sin,
    rope_spec_from_config,
)
from sglang_hicache_ext.fusion.selectors import (
    SELECTORS,
    CheckLayerState,
    SelectionContext,
    Selector,
    make_selector,
)

__all__ = [
    "LayerAttention",
    "SELECTORS",
    "AttentionInputs",
    "CheckLayerState",
    "ChunkSegment",
    "FusionResult",
    "GenerationResult",
    "KVCache",
    "ModelAdapter",
    "ModelShape",
    "PrecomputedChunk",
    "RequestLayout",
    "RopeSpec",
    "SelectionContext",
    "Selector",
    "TextSegment",
    "apply_rope",
    "layer_rope_specs",
    "attend",
    "build_layout",
    "chunk_hash",
    "decode_step",
    "flashinfer_available",
    "frequency_scores",
    "fused_prefill",
    "gather_attend",
    "generate_greedy",
    "low_pass",
    "make_selector",
    "position_causal_attention",
    "precompute_chunk",
    "rope_cos_sin",
    "rope_spec_from_config",
]
