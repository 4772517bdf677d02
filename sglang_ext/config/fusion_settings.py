"""The fusion part of the extension's settings: the server's defaults of a request's fusion
options and what decides whether and how much it fuses (ratio, shadow checks, break-even).

`ExtensionSettings` (settings.py) extends it with the chunk tiers, capture and admission; the
two are one model, one file of settings, one reference table (docs/reference.md). Kept apart
because these are per-request decisions, the rest is storage.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from sglang_hicache_ext.sglang_ext.config.setting_types import (
    ContextTempering,
    DecodeCapacity,
    FreshLayers,
    RatioOrAuto,
    SelectorName,
    Share,
    SinkTokens,
)

# The default quality target of "auto": chosen from the retention harness's ratio curve on
# Qwen2.5-0.5B (docs/fusion-quality.md, "Fidelity in production").
DEFAULT_TARGET_AGREEMENT = 0.9


class FusionSettings(BaseModel):
    """The fusion settings; every field has a sane default."""

    # strict: a TOML `1` is not `true`, `1.5` not an int; values come from files, not forms.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    fusion_by_default: bool = Field(False, description="Server default of custom_params.fusion.")
    # question_attention (the question's attention over several layers, from a scoring pass)
    # with 8 sink tokens: the closest to the full prefill measured on Qwen2.5-0.5B, chosen on
    # the held-out questions and measured on the 200 evaluation ones (docs/fusion-quality.md).
    fusion_selector: SelectorName = Field(
        "question_attention", description="Server default of custom_params.fusion_selector."
    )
    # "auto" with a target: how much to recompute is a property of the model and the workload,
    # measured live by the shadow checks, not a constant (docs/fusion-quality.md, "Fidelity in
    # production").
    fusion_recompute_ratio: RatioOrAuto = Field(
        "auto",
        description='Server default of custom_params.fusion_recompute_ratio; "auto" uses the '
        "ratio tuned for the tier each chunk is loaded from: from fusion_ratio_table, else "
        "self-tuned from the server's own prefills, never below the model's quality floor; "
        "with fusion_target_agreement, raised from there until the shadow checks meet it.",
    )
    fusion_target_agreement: Share | None = Field(
        DEFAULT_TARGET_AGREEMENT,
        description='With the ratio "auto": the share of served tokens that must be the normal '
        "prefill's greedy choice, as the shadow checks measure it; each chunk tier's ratio is "
        'raised while the checks agree less and lowered (never below what "auto" gives '
        "without a target) while they agree more than target + 0.05. Null: no target.",
    )
    # Where fused and normal TTFT cross on SmolLM2, CPU (benchmarks/fusion_break_even.py,
    # docs/auto-chunks.md "When fusion does not pay"): fused already wins at the lowest share
    # measured, 0.08, since the scoring pass's read is bounded by what reuse saves (0.14 when
    # it read the question's last 96 tokens, 0.30 when it read the whole tail); the pass's
    # fixed 32-token floor puts the crossing near 0.03 on ~900-token prompts.
    fusion_min_matched_share: Share = Field(
        0.05,
        description='With the ratio "auto": a request whose stored chunks cover less than this '
        "share of the tokens it would prefill (past its cached prefix) gets the normal prefill, "
        "fallback below_break_even: below it the fused path's own costs outweigh the compute "
        "reuse saves. A request that names its ratio is fused as it asks. 0: no minimum.",
    )
    fusion_shadow_rate: Share = Field(
        0.25,
        description="Share of fused, greedily decoded requests checked after they are answered: "
        "the prompt and the served tokens prefilled once more with fusion off, on spare "
        "capacity only (custom_params.fusion_shadow forces or skips one). 0: no checks.",
    )
    fusion_shadow_tokens: int = Field(
        16,
        ge=1,
        le=1024,
        description="How many of a checked request's first served tokens are compared with the "
        "normal prefill's greedy choice.",
    )
    fusion_shadow_idle_s: float = Field(
        0.5,
        ge=0,
        le=3600,
        allow_inf_nan=False,
        description="A check starts only after the server has served no request for this long "
        "(spare capacity); a request that arrives meanwhile goes first.",
    )
    fusion_shadow_queue: int = Field(
        32,
        ge=1,
        le=4096,
        description="Most checks waiting for spare capacity; one more is dropped and counted.",
    )
    fusion_shadow_window: int = Field(
        64,
        ge=1,
        le=100000,
        description="How many of the latest checks /server_info's rolling window averages.",
    )
    # Off unless asked: live on Qwen2.5 at a pinned r = 0.15 the later asks of recurring
    # document sets kept 0.96 of served tokens against 0.83 without, but at r = 0.5 (the
    # default's ratio there) answers are at the ceiling already and 1 of 5 reads went lower
    # (docs/fusion-quality.md, "A check's rows for the same documents").
    fusion_shadow_refresh: bool = Field(
        False,
        description="A shadow check keeps the rows it computed of each chunk span its prompt "
        "matched, in host memory, for the prompt's document set; a later fused prompt of the "
        "same documents, in any order, reads them instead of the stored rows. Never written "
        "to a chunk tier.",
    )
    fusion_context_variant_bytes: int = Field(
        1024**3,
        gt=0,
        description="Host memory for the rows fusion_shadow_refresh keeps, per scheduler "
        "process, beside chunk_store_bytes; LRU beyond it.",
    )
    fusion_ratio_table: str | None = Field(
        None,
        description="JSON file of recompute ratios tuned per chunk tier for the served model "
        '(python -m sglang_hicache_ext.tuning.ratio tune); enables the ratio "auto".',
    )
    fusion_sink_tokens: SinkTokens = Field(
        8,
        description="First tokens of each chunk put first in the recompute budget "
        "(0 = the papers' selectors).",
    )
    fusion_fresh_layers: FreshLayers = Field(
        0,
        description="Server default of custom_params.fusion_fresh_layers: every token is "
        "computed in this many first layers and that KV kept, before the prefill narrows to "
        "the selection.",
    )
    fusion_context_temperature: ContextTempering = Field(
        1.0,
        description="Server default of custom_params.fusion_context_temperature: APE's "
        "temperature of the question's attention over the chunks (1: plain attention).",
    )
    fusion_context_scale: ContextTempering = Field(
        1.0,
        description="Server default of custom_params.fusion_context_scale: APE's scale of the "
        "chunks' share of the question's attention (1: plain attention).",
    )
    fusion_overlap_loads: bool = Field(
        True,
        description="Server default of custom_params.fusion_overlap_loads: read the next "
        "layer's rows of disk chunks while this layer computes.",
    )
    fusion_decode_capacity: DecodeCapacity | None = Field(
        None,
        description="Server default of custom_params.fusion_decode_capacity: after a fused "
        "prefill the decode attends this share of the prompt's tokens (null: all of them).",
    )
