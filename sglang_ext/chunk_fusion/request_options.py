"""Per-request fusion options: the flat `custom_params` keys, their server defaults, validation.

Flat keys, because SGLang types `custom_params` as flat JSON (nested values survive its IPC only
while it pickles). Unset keys take the server defaults from the extension settings; the value
types and bounds are the settings' own (`SelectorName`, `RecomputeRatio`, `SinkTokens`, `DecodeCapacity`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails

from sglang_hicache_ext.sglang_ext.config.setting_types import (
    DECODE_CAPACITY_CHOICES,
    ContextTempering,
    DecodeCapacity,
    FreshLayers,
    RatioOrAuto,
    SelectorName,
    SinkTokens,
    selector_choices,
)
from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings
from sglang_hicache_ext.sglang_ext.config.validation_messages import bound_phrase

ENABLE_KEY = "fusion"
SELECTOR_KEY = "fusion_selector"
RATIO_KEY = "fusion_recompute_ratio"
SINK_KEY = "fusion_sink_tokens"
FRESH_KEY = "fusion_fresh_layers"
TEMPERATURE_KEY = "fusion_context_temperature"
SCALE_KEY = "fusion_context_scale"
OVERLAP_KEY = "fusion_overlap_loads"
DECODE_CAPACITY_KEY = "fusion_decode_capacity"
# No server default of its own: unset, a fused request is checked at fusion_shadow_rate.
SHADOW_KEY = "fusion_shadow"
META_KEY = "hicache_ext_fusion"

# Each option's custom_params key and the setting that is its server default.
SERVER_DEFAULTS: Mapping[str, str] = MappingProxyType(
    {
        ENABLE_KEY: "fusion_by_default",
        SELECTOR_KEY: "fusion_selector",
        RATIO_KEY: "fusion_recompute_ratio",
        SINK_KEY: "fusion_sink_tokens",
        FRESH_KEY: "fusion_fresh_layers",
        TEMPERATURE_KEY: "fusion_context_temperature",
        SCALE_KEY: "fusion_context_scale",
        OVERLAP_KEY: "fusion_overlap_loads",
        DECODE_CAPACITY_KEY: "fusion_decode_capacity",
    }
)
OPTION_KEYS: tuple[str, ...] = (*SERVER_DEFAULTS, SHADOW_KEY)


class FusionOptions(BaseModel):
    """The fusion options of one request, every one set (unset keys were given the defaults)."""

    # strict: JSON `1` is not `true` and `"0.1"` not a ratio; a wrong type is the client's 400.
    model_config = ConfigDict(
        frozen=True, strict=True, extra="forbid", validate_by_name=True, validate_by_alias=True
    )

    enabled: bool = Field(
        alias=ENABLE_KEY, description="Fuse this request: reuse stored chunks it contains."
    )
    selector: SelectorName = Field(
        alias=SELECTOR_KEY, description="Which chunk tokens are recomputed (see the selectors)."
    )
    recompute_ratio: RatioOrAuto = Field(
        alias=RATIO_KEY,
        description='Share of chunk tokens recomputed, in [0, 1], or "auto" (tuned per tier).',
    )
    sink_tokens: SinkTokens = Field(
        alias=SINK_KEY, description="First tokens of each chunk put first in the recompute budget."
    )
    fresh_layers: FreshLayers = Field(
        alias=FRESH_KEY, description="First layers in which every chunk token is computed."
    )
    context_temperature: ContextTempering = Field(
        alias=TEMPERATURE_KEY,
        description="APE's temperature of the question's attention to chunk keys (1: off).",
    )
    context_scale: ContextTempering = Field(
        alias=SCALE_KEY,
        description="APE's scale of the chunks' share of the question's attention (1: off).",
    )
    overlap_loads: bool = Field(
        alias=OVERLAP_KEY,
        description="Read the next layer's rows of disk chunks while this layer computes.",
    )
    decode_capacity: DecodeCapacity | None = Field(
        None,
        alias=DECODE_CAPACITY_KEY,
        description="Share of the prompt's tokens the decode attends, in (0, 1]; null: all.",
    )
    shadow: bool | None = Field(
        None,
        alias=SHADOW_KEY,
        description="true: check this fused request against the normal prefill after it is "
        "answered (if it is fused and decoded greedily); false: never; null: at the setting "
        "fusion_shadow_rate.",
    )


def parse_options(custom_params: Any, defaults: ExtensionSettings) -> FusionOptions:
    """Options of one request; ValueError (HTTP 400) for malformed ones.

    Types are checked before values (strict model): a list or object where a string is
    expected is a 400, not an unhashable-type error in the membership test (a 500)."""
    params = {} if custom_params is None else custom_params
    if not isinstance(params, dict):
        raise ValueError("sampling_params.custom_params must be an object")
    # Only our keys: custom_params may carry other plugins' keys too.
    values = {
        key: params.get(key, getattr(defaults, name)) for key, name in SERVER_DEFAULTS.items()
    }
    values[SHADOW_KEY] = params.get(SHADOW_KEY)
    try:
        options = FusionOptions.model_validate(values)
    except ValidationError as err:
        raise ValueError(_refusal(err.errors()[0])) from None
    return options


# What each value type must be, in the words of a 400.
_MUST_BE = MappingProxyType({bool: "true or false", float: "a number", int: "an integer"})


def _refusal(error: ErrorDetails) -> str:
    key = str(error["loc"][0])
    given = _short(error["input"])
    if key == SELECTOR_KEY:  # a wrong type or an unknown name: the same answer
        return f"custom_params.{key} = {given} {selector_choices()}"
    if key == RATIO_KEY:  # a union: pydantic reports one error per member
        return f'custom_params.{key} must be a number in [0, 1] or "auto", got {given}'
    if key == DECODE_CAPACITY_KEY:  # a number or null
        return f"custom_params.{key} {DECODE_CAPACITY_CHOICES} (or null), got {given}"
    if key == SHADOW_KEY:  # true, false or null
        return f"custom_params.{key} must be true or false (or null), got {given}"
    field = next(f for f in FusionOptions.model_fields.values() if f.alias == key)
    assert isinstance(field.annotation, type)  # the other options are answered above
    must_be = " ".join(filter(None, (_MUST_BE[field.annotation], bound_phrase(field))))
    return f"custom_params.{key} must be {must_be}, got {given}"


def _short(value: Any, limit: int = 80) -> str:
    # Error messages echo the client's value; a megabyte-long one must not come back whole.
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
