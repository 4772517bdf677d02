"""What a shadow check's request carries, who may send one, and how the scheduler treats it.

A shadow check (`server/shadow_checks.py`) prefills a fused request's prompt and served tokens
once more with fusion off, to compare the served tokens with the normal prefill's greedy choice.
Its request carries the checked request's id under an internal `custom_params` key. In the
scheduler it must not change what users see: it never enters the prefix tree (its rows are exact,
but a user's later prompt must not find the cache changed by a check), is not recorded as an
access of the disk tier's pages and loads nothing from HiCache's storage, is never batched with
users' requests and waits behind every user request in the queue, and is prefilled in small
rounds so that a user request arriving while it runs waits for one round at most. What it
computed may stay behind only as variants of the documents it holds, for prompts of the same
documents (`keep_shadow_check_rows`, setting `fusion_shadow_refresh`), never in the tree.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from sglang_hicache_ext.fusion.chunk import PrecomputedChunk
from sglang_hicache_ext.fusion.frequency import stacked_frequency_scores
from sglang_hicache_ext.sglang_ext.chunk_fusion.context_variants import (
    ContextVariants,
    document_set,
)
from sglang_hicache_ext.sglang_ext.chunk_fusion.pool_rows import bytes_per_token, pre_rope_rows
from sglang_hicache_ext.sglang_ext.chunk_fusion.registry import ChunkRegistry

T = TypeVar("T")
logger = logging.getLogger(__name__)

SHADOW_PARAM = "hicache_ext_shadow_of"  # internal: the id of the request being checked
# The control method (after `hicache_ext.`) that brings a check's result to the scheduler.
FIDELITY_RECORD_METHOD = "fidelity.record"
# A check's prompt is prefilled in rounds of at most this many tokens, whatever the server's
# --chunked-prefill-size: a user request that arrives meanwhile waits for one such round (the
# HTTP process aborts the check, `server/shadow_checks.py`), not for a whole prompt. 128: with
# 512 a user arriving during a check paid +7 % median TTFT on SmolLM2's 3K-token prompts
# (benchmarks/shadow_cost.py --think-s 1); a CPU forward of 128 tokens is still efficient.
ROUND_TOKENS = 128

# Set by the shadow checks around their own requests; a client sending SHADOW_PARAM is refused.
running_shadow_check: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "hicache_ext_running_shadow_check", default=False
)


def check_shadow_params(custom_params: Any) -> None:
    """ValueError (HTTP 400) for the internal key sent by a client."""
    if (
        isinstance(custom_params, dict)
        and SHADOW_PARAM in custom_params
        and not running_shadow_check.get()
    ):
        raise ValueError(f"custom_params.{SHADOW_PARAM} is internal to the shadow checks")


def shadow_of(req: Any) -> str | None:
    """The id of the request a shadow check's request checks, else None."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None) or {}
    value = params.get(SHADOW_PARAM)
    return value if isinstance(value, str) else None


def bar_from_tree(req: Any) -> None:
    """A shadow check's rows never enter the prefix tree (SGLang's own flag for rows that must
    not be shared; checked at every checkpoint and at release)."""
    if shadow_of(req) is not None:
        req.skip_radix_cache_insert = True


def users_first(waiting_queue: list[Any]) -> None:
    """Move shadow checks behind every user request, keeping each group's order."""
    if any(shadow_of(req) is not None for req in waiting_queue):
        users = [req for req in waiting_queue if shadow_of(req) is None]
        checks = [req for req in waiting_queue if shadow_of(req) is not None]
        waiting_queue[:] = users + checks


def in_small_rounds(adder: Any, add: Callable[[], T]) -> T:
    """Admit a shadow check's next round (`add`) with at most ROUND_TOKENS of SGLang's
    chunked-prefill budget; the rest of the budget is the batch's as before."""
    budget = adder.rem_chunk_tokens
    if budget is None or budget <= ROUND_TOKENS:  # chunked prefill off, or rounds small already
        return add()
    adder.rem_chunk_tokens = ROUND_TOKENS
    try:
        return add()
    finally:
        adder.rem_chunk_tokens = budget - (ROUND_TOKENS - adder.rem_chunk_tokens)


def keep_shadow_check_rows(
    registry: ChunkRegistry, requests: Mapping[str, Any], runner: Any, forward_batch: Any
) -> int:
    """After a prefill forward: the rows of each shadow check whose last round it computed kept
    as variants of the chunk spans its prompt matched. Returns how many were kept.

    A check's rows are exact: it is prefilled with fusion off, and the only rows it does not
    compute are the prefix tree's, which only normal prefills enter (fused rows never do). A
    failure here is logged and counted, never raised: the variants are an optional copy and
    the forward's batch must go on."""
    variants = registry.context_variants
    if variants is None:
        return 0
    kept = 0
    rounds = zip(
        forward_batch.rids or [],
        forward_batch.extend_prefix_lens_cpu,
        forward_batch.extend_seq_lens_cpu,
        strict=True,
    )
    for index, (rid, prefix_len, extend_len) in enumerate(rounds):
        req = requests.get(rid)
        if req is None or shadow_of(req) is None:
            continue
        token_ids = [int(t) for t in req.origin_input_ids]
        if prefix_len + extend_len < len(token_ids):
            continue  # an earlier round: the prompt's later rows are not computed yet
        # The checked prompt, not its served tokens after it: a later prompt holds only that.
        # The check asks input logprobs from the prompt's last token on (server/shadow_checks.py).
        start = getattr(req, "logprob_start_len", -1)
        prompt = token_ids[: start + 1] if 0 <= start < len(token_ids) else token_ids
        row = forward_batch.req_pool_indices[index]
        slots = runner.req_to_token_pool.req_to_token[row, : len(prompt)]
        try:
            kept += _keep_rows(registry, variants, prompt, runner.token_to_kv_pool, slots)
        except Exception:  # a bug or an allocation failure: the batch goes on without them
            logger.exception("shadow check %s: its rows not kept", rid)
            variants.failed_capture()
    return kept


def _keep_rows(
    registry: ChunkRegistry,
    variants: ContextVariants,
    token_ids: list[int],
    kv_pool: Any,
    slots: torch.Tensor,
) -> int:
    """The rows at `slots` (the prompt's, positions 0..n-1) of every matched chunk span."""
    matches = registry.find(token_ids)
    documents = document_set(matches)
    per_token = bytes_per_token(kv_pool)  # before any row is copied
    kept = 0
    for match in matches:
        if not variants.fits(match.length * per_token):
            continue
        positions = torch.arange(match.prompt_start, match.prompt_end, device=slots.device)
        span = slots[match.prompt_start : match.prompt_end].to(torch.long)
        keys, values = pre_rope_rows(kv_pool, span, positions, registry.rope)
        chunk = PrecomputedChunk(
            token_ids=tuple(token_ids[match.prompt_start : match.prompt_end]),
            keys=tuple(keys.unbind(0)),
            values=tuple(values.unbind(0)),
            freq_scores=stacked_frequency_scores(keys, values, registry.alpha),
            alpha=registry.alpha,
        )
        kept += variants.keep(documents, match, chunk)
    return kept
