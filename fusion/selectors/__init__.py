"""Which chunk tokens to recompute: one strategy per module behind one `score()` / `select()`
contract (`base.py`), built by name through `registry.py`."""

from sglang_hicache_ext.fusion.selectors.attention_error import QuestionErrorSelector
from sglang_hicache_ext.fusion.selectors.base import (
    CheckLayerState,
    SelectionContext,
    Selector,
    check_ratio,
    top_k,
)
from sglang_hicache_ext.fusion.selectors.check_layer_attention import A3Selector, question_logits
from sglang_hicache_ext.fusion.selectors.chunk_start import EpicSelector
from sglang_hicache_ext.fusion.selectors.fixed_ratio import FullSelector, ReuseSelector
from sglang_hicache_ext.fusion.selectors.frequency import FrequencySelector
from sglang_hicache_ext.fusion.selectors.kv_deviation import CacheBlendSelector
from sglang_hicache_ext.fusion.selectors.random_tokens import RandomSelector
from sglang_hicache_ext.fusion.selectors.registry import SELECTORS, make_selector
from sglang_hicache_ext.fusion.selectors.scoring_pass_attention import QuestionAttentionSelector

__all__ = [
    "SELECTORS",
    "A3Selector",
    "CacheBlendSelector",
    "CheckLayerState",
    "EpicSelector",
    "FrequencySelector",
    "FullSelector",
    "QuestionAttentionSelector",
    "QuestionErrorSelector",
    "RandomSelector",
    "ReuseSelector",
    "SelectionContext",
    "Selector",
    "check_ratio",
    "make_selector",
    "question_logits",
    "top_k",
]
