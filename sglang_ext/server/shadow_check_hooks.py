"""Which requests SGLang's tokenizer manager hands to the shadow checks, and when.

Hooks registered by plugin.py in the HTTP process: `remember_prompt` (AROUND
`TokenizerManager._tokenize_one_request`) keeps the prompt ids of a request that may be checked,
`track_request` (AROUND `TokenizerManager.generate_request`) counts users' requests in flight
for the checks' idle gate and offers each user's final answer to `ShadowChecks.consider`
(`shadow_checks.py`). A request may be checked when fusion is on for it, a check is due (rate
or `custom_params.fusion_shadow`) and it was decoded greedily; the extension's own requests
(registrations, placement probes, checks) are never checked.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_hicache_ext.sglang_ext.chunk_fusion.placement_probe import probing_placement
from sglang_hicache_ext.sglang_ext.chunk_fusion.registration import registering_chunk
from sglang_hicache_ext.sglang_ext.chunk_fusion.request_options import ENABLE_KEY, SHADOW_KEY
from sglang_hicache_ext.sglang_ext.chunk_fusion.shadow_request import running_shadow_check
from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings
from sglang_hicache_ext.sglang_ext.server.http_state import http_state
from sglang_hicache_ext.sglang_ext.server.shadow_checks import ShadowChecks

logger = logging.getLogger(__name__)

_HEALTH_RID = "HEALTH_CHECK"  # SGLang's /health_generate probes: no user, no load


def internal_request() -> bool:
    """The request running now was sent by the extension itself (registration, placement probe,
    shadow check): it is neither a user's request nor a candidate for a check."""
    return registering_chunk.get() or probing_placement.get() or running_shadow_check.get()


def served_greedily(tokenized: Any) -> bool:
    """Every served token was the model's greedy choice: temperature 0 or top-k 1 (the
    sampling parameters as SGLang resolved them, server-side preferences merged), and nothing
    that changes a token after the logits (penalties, a bias, a grammar, a minimum length, a
    watermark, a custom logit processor, a thinking budget) — whose tokens would disagree with
    the normal prefill's raw greedy choice whatever the KV."""
    params = getattr(tokenized, "sampling_params", None)
    if params is None:
        return False
    neutral = (
        getattr(params, "frequency_penalty", 0.0) == 0.0
        and getattr(params, "presence_penalty", 0.0) == 0.0
        and getattr(params, "repetition_penalty", 1.0) == 1.0
        and getattr(params, "min_new_tokens", 0) == 0
        and not getattr(params, "ignore_eos", False)
        and not getattr(params, "logit_bias", None)
        and getattr(params, "watermark", None) is None
        and all(
            getattr(params, name, None) is None
            for name in ("json_schema", "regex", "ebnf", "structural_tag")
        )
        and getattr(tokenized, "custom_logit_processor", None) is None
        and getattr(tokenized, "max_thinking_tokens", None) is None
    )
    return neutral and (params.temperature == 0 or params.top_k == 1)


def _may_be_checked(obj: Any, settings: ExtensionSettings) -> bool:
    params = getattr(obj, "sampling_params", None)
    custom = (params.get("custom_params") if isinstance(params, dict) else None) or {}
    if not isinstance(custom, dict) or not custom.get(ENABLE_KEY, settings.fusion_by_default):
        return False
    forced = custom.get(SHADOW_KEY)
    return forced is True or (forced is None and settings.fusion_shadow_rate > 0)


async def remember_prompt(original: Any, manager: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND TokenizerManager._tokenize_one_request: a request that may be checked keeps its
    prompt's token ids (and its state, whose output ids are complete when it finishes) until
    its answer, when `consider` takes them."""
    tokenized = await original(manager, obj, *args, **kwargs)
    checks = http_state(manager).shadow_checks
    if not internal_request() and _may_be_checked(obj, checks.settings):
        state = manager.rid_to_state.get(tokenized.rid)
        if state is not None:
            checks.prompts[tokenized.rid] = (
                state,
                tokenized.input_ids,
                served_greedily(tokenized),
            )
    return tokenized


async def track_request(
    original: Any, manager: Any, obj: Any, request: Any = None, *args: Any, **kwargs: Any
) -> Any:
    """AROUND TokenizerManager.generate_request: requests in flight (the checks' idle gate; the
    extension's own registrations and probes hold it too, health probes do not), and each
    user's single request's final output offered to the checks."""
    if running_shadow_check.get() or str(getattr(obj, "rid", "")).startswith(_HEALTH_RID):
        async for item in original(manager, obj, request, *args, **kwargs):
            yield item
        return
    checks = http_state(manager).shadow_checks
    user = not internal_request()
    checks.user_started()
    finished = False
    try:
        async for item in original(manager, obj, request, *args, **kwargs):
            # A batch (or n > 1) is in flight until its generator ends, not at its first answer.
            if not finished and getattr(obj, "is_single", False) and _final(item):
                finished = True
                checks.user_finished()
                if user:
                    _consider(checks, obj, item)
            yield item
    finally:
        if not finished:
            checks.user_finished()
        rids = getattr(obj, "rid", None)
        for rid in rids if isinstance(rids, list) else [rids]:
            checks.prompts.pop(str(rid), None)


def _consider(checks: ShadowChecks, obj: Any, item: dict[str, Any]) -> None:
    # The answer has been served: nothing here may fail the user's request.
    try:
        checks.consider(obj, item)
    except Exception:  # noqa: BLE001
        logger.exception("shadow check of request %s not queued", getattr(obj, "rid", "?"))
        checks.counts["failed"] += 1


def _final(item: Any) -> bool:
    return isinstance(item, dict) and (item.get("meta_info") or {}).get("finish_reason") is not None
