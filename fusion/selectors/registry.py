"""Selectors by name: the one place the settings, the options and the benchmarks build them."""

from __future__ import annotations

from sglang_hicache_ext.fusion.selectors.attention_error import QuestionErrorSelector
from sglang_hicache_ext.fusion.selectors.base import Selector, check_ratio
from sglang_hicache_ext.fusion.selectors.check_layer_attention import A3Selector
from sglang_hicache_ext.fusion.selectors.chunk_start import EpicSelector
from sglang_hicache_ext.fusion.selectors.fixed_ratio import FullSelector, ReuseSelector
from sglang_hicache_ext.fusion.selectors.frequency import FrequencySelector
from sglang_hicache_ext.fusion.selectors.kv_deviation import CacheBlendSelector
from sglang_hicache_ext.fusion.selectors.random_tokens import RandomSelector
from sglang_hicache_ext.fusion.selectors.scoring_pass_attention import QuestionAttentionSelector

# A new selector is one file with one `Selector` subclass and one line here; its `name` is what
# settings and request options spell (the settings' choices are read from this mapping).
SELECTORS: dict[str, type[Selector]] = {
    cls.name: cls
    for cls in (
        QuestionErrorSelector,
        QuestionAttentionSelector,
        A3Selector,
        FrequencySelector,
        CacheBlendSelector,
        EpicSelector,
        RandomSelector,
        ReuseSelector,
        FullSelector,
    )
}


def make_selector(name: str, ratio: float, **options: object) -> Selector:
    """Selector by name (see SELECTORS); `full` and `reuse` ignore ratio beyond validating it."""
    check_ratio(ratio)
    if name not in SELECTORS:
        raise ValueError(f"unknown selector {name!r}; choose from {sorted(SELECTORS)}")
    return SELECTORS[name](ratio, **options)  # type: ignore[arg-type]
