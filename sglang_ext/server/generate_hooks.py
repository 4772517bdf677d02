"""Fusion's hooks on SGLang's tokenizer manager, in the HTTP process.

`validate_request` (BEFORE `TokenizerManager.generate_request`) answers 400 to bad fusion
options before a request reaches the scheduler; `observe_fused_ttft` (AROUND
`TokenizerManager.collect_metrics`) observes the TTFT of requests whose every prefill round was
fused. Both read this server's `HttpProcessState` (`http_state.py`).
"""

from __future__ import annotations

from typing import Any

from sglang_hicache_ext.sglang_ext.chunk_fusion.placement_probe import check_probe_params
from sglang_hicache_ext.sglang_ext.chunk_fusion.registration import (
    REGISTER_PARAM,
    registering_chunk,
)
from sglang_hicache_ext.sglang_ext.chunk_fusion.request_options import META_KEY, parse_options
from sglang_hicache_ext.sglang_ext.chunk_fusion.shadow_request import (
    SHADOW_PARAM,
    check_shadow_params,
)
from sglang_hicache_ext.sglang_ext.server.http_state import http_state


def validate_request(tokenizer_manager: Any, obj: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook on TokenizerManager.generate_request (launching process): 400 on bad options,
    and on the internal registration key unless `POST /chunks` itself sent the request."""
    params = getattr(obj, "sampling_params", None)
    batch = params if isinstance(params, list) else [params]
    settings = http_state(tokenizer_manager).settings
    for sampling in batch:
        if isinstance(sampling, dict):
            custom = sampling.get("custom_params")
            if (
                isinstance(custom, dict)
                and REGISTER_PARAM in custom
                and not registering_chunk.get()
            ):
                raise ValueError(
                    f"custom_params.{REGISTER_PARAM} is internal; register chunks with POST /chunks"
                )
            check_probe_params(custom)
            check_shadow_params(custom)
            parse_options(custom, settings)


def observe_fused_ttft(original: Any, manager: Any, state: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `TokenizerManager.collect_metrics` (runs only with `--enable-metrics`): when SGLang
    observes a request's TTFT and every prefill round of it was fused, observe it for fusion too.
    A shadow check's request is left out of SGLang's own series (TTFT, tokens, requests)."""
    custom = getattr(state.obj, "sampling_params", None)
    custom = (custom.get("custom_params") if isinstance(custom, dict) else None) or {}
    if isinstance(custom, dict) and SHADOW_PARAM in custom:
        return None  # a shadow check is not a user's request: SGLang's series do not count it
    already_observed = state.ttft_observed
    result = original(manager, state, *args, **kwargs)
    if already_observed or not state.ttft_observed:
        return result
    rounds = state.customized_info_accumulated.get(META_KEY) or []
    if rounds and all(info and info.get("fused") and "probe_form" not in info for info in rounds):
        http_state(manager).fused_ttft().observe(
            rounds[-1]["selector"], state.time_stats.get_first_token_latency()
        )
    return result
