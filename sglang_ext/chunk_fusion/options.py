"""Per-request fusion options: the flat `custom_params` keys, their server defaults, validation.

Flat keys, because SGLang types `custom_params` as flat JSON (nested values survive its IPC only
while it pickles). Unset keys take the server defaults from the extension settings.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sglang_hicache_ext.fusion.selectors import SELECTORS
from sglang_hicache_ext.sglang_ext.server.settings import ExtensionSettings

ENABLE_KEY = "fusion"
SELECTOR_KEY = "fusion_selector"
RATIO_KEY = "fusion_recompute_ratio"
SINK_KEY = "fusion_sink_tokens"
META_KEY = "hicache_ext_fusion"


@dataclasses.dataclass(frozen=True)
class FusionOptions:
    enabled: bool
    selector: str
    recompute_ratio: float
    sink_tokens: int = 0


def parse_options(custom_params: Any, defaults: ExtensionSettings) -> FusionOptions:
    """Options of one request; ValueError (HTTP 400) for malformed ones.

    Types are checked before values: a list or object where a string is expected must be a
    400, not an unhashable-type error in the membership test (a 500)."""
    params = {} if custom_params is None else custom_params
    if not isinstance(params, dict):
        raise ValueError("sampling_params.custom_params must be an object")
    enabled = params.get(ENABLE_KEY, defaults.fusion_by_default)
    selector = params.get(SELECTOR_KEY, defaults.fusion_selector)
    ratio = params.get(RATIO_KEY, defaults.fusion_recompute_ratio)
    sink_tokens = params.get(SINK_KEY, defaults.fusion_sink_tokens)
    if not isinstance(enabled, bool):
        raise ValueError(f"custom_params.{ENABLE_KEY} must be true or false, got {_short(enabled)}")
    if not isinstance(selector, str) or selector not in SELECTORS:
        raise ValueError(
            f"custom_params.{SELECTOR_KEY} = {_short(selector)} is unknown; choose from {sorted(SELECTORS)}"
        )
    if (
        isinstance(ratio, bool)
        or not isinstance(ratio, int | float)
        or not 0.0 <= ratio <= 1.0  # also refuses NaN
    ):
        raise ValueError(
            f"custom_params.{RATIO_KEY} must be a number in [0, 1], got {_short(ratio)}"
        )
    if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or sink_tokens < 0:
        raise ValueError(
            f"custom_params.{SINK_KEY} must be an integer >= 0, got {_short(sink_tokens)}"
        )
    return FusionOptions(enabled, selector, float(ratio), sink_tokens)


def _short(value: Any, limit: int = 80) -> str:
    # Error messages echo the client's value; a megabyte-long one must not come back whole.
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
