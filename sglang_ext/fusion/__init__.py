"""Engine-agnostic fusion core: attention ops, RoPE recovery, selectors, executor.

Imports torch only, never sglang, so it runs and benchmarks where SGLang cannot be installed.
"""

from sglang_ext.fusion.attention import gather_attend, position_causal_attention

__all__ = ["gather_attend", "position_causal_attention"]
