"""Non-prefix chunk fusion inside SGLang's prefill.

Per request, `sampling_params.custom_params` (flat keys, so they survive SGLang's IPC):
  `fusion` (bool), `fusion_selector` (str), `fusion_recompute_ratio` (float in [0, 1]),
  `fusion_sink_tokens` (int >= 0: the first tokens of each chunk go first in the budget),
  `fusion_overlap_loads` (bool: read disk chunk rows a layer ahead, under the compute);
unset keys take the server defaults from the extension settings.

At forward time (AROUND `ModelRunner._forward_raw`), an extend batch in which every request is
fused runs through the fusion executor instead of the model's forward (`fused_forward.py`):
the exact prefix SGLang matched in its tree is reused as is, chunk tokens reuse the stored KV
(RoPE re-applied at their global positions) except the selected fraction, other tokens are
computed, the resulting K/V are written to exactly the KV slots SGLang allocated for the round
(a prompt split across chunked-prefill rounds is computed whole in its first round and written
round by round), and decode then proceeds in SGLang unchanged. Fused KV is approximate, so a
fused request never inserts into the prefix tree (`skip_radix_cache_insert`): a later request
must not inherit KV that its token ids alone do not determine.

A batch is fused only when *all* its requests are: any other request (no fusion asked, hidden
states asked, ...) is computed by SGLang's own forward. To keep such mixed batches rare,
admission (AROUND `PrefillAdder.add_one_req`) keeps requests that will be fused and requests
that will not in separate batches, as SGLang itself does for pooling modes. A request that asked
for fusion and gets the normal prefill is logged, counted and reported in its response
(`meta_info.hicache_ext_fusion[i].fallback`).
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_hicache_ext.sglang_ext.chunk_fusion.fused_forward import (
    model_check_prompts,
    run_fused_batch,
)
from sglang_hicache_ext.sglang_ext.chunk_fusion.plan import (
    count_fallbacks,
    fall_back,
    plan_batch,
    plan_mixed_batch,
    will_fuse,
)
from sglang_hicache_ext.sglang_ext.chunk_fusion.rank_agreement import (
    RANKS_DISAGREE,
    RanksDisagreeError,
    plans_agree,
)
from sglang_hicache_ext.sglang_ext.chunk_fusion.request_options import META_KEY
from sglang_hicache_ext.sglang_ext.chunk_fusion.service import FusionService, service_of
from sglang_hicache_ext.sglang_ext.chunk_fusion.shadow_request import (
    bar_from_tree,
    in_small_rounds,
    keep_shadow_check_rows,
    shadow_of,
    users_first,
)
from sglang_hicache_ext.sglang_ext.sglang_types import (
    ExtendBatch,
    ModelRunnerLike,
    PrefillAdderLike,
    ScheduledRequest,
    SchedulerLike,
)
from sglang_hicache_ext.tiers.chunks.header import CorruptChunkError

logger = logging.getLogger(__name__)

# ---- hooks ------------------------------------------------------------------------------


def remember_request(
    req: ScheduledRequest, scheduler: SchedulerLike, *args: Any, **kwargs: Any
) -> ScheduledRequest:
    """AFTER hook on Scheduler._create_generation_req: the forward hook finds requests by rid;
    a shadow check's request is barred from the prefix tree."""
    if (service := service_of(scheduler.tree_cache)) is not None:
        service.requests[req.rid] = req
    bar_from_tree(req)
    return req


def captures_after_results(result: Any, scheduler: SchedulerLike, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook on Scheduler.process_batch_result: the pieces the batch's prompts brought are
    captured once their first tokens are sent (`AutoCapture.defer`)."""
    run_deferred_captures(scheduler)
    return result


def run_deferred_captures(scheduler: SchedulerLike, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook on Scheduler.get_next_batch_to_run as well: no capture is left pending when
    KV is allocated again (the rows it copies may be freed, not yet reused)."""
    service = service_of(scheduler.tree_cache)
    if service is not None and service.auto_capture is not None:
        service.auto_capture.run_deferred()


def shadow_checks_last(
    result: Any, policy: Any, waiting_queue: Any, *args: Any, **kwargs: Any
) -> Any:
    """AFTER hook on SchedulePolicy.calc_priority: shadow checks wait behind every user request
    whatever the policy's order."""
    if isinstance(waiting_queue, list):
        users_first(waiting_queue)
    return result


def keep_batches_homogeneous(
    original: Any, adder: PrefillAdderLike, req: ScheduledRequest, *args: Any, **kwargs: Any
) -> Any:
    """AROUND hook on PrefillAdder.add_one_req: requests that will be fused and requests that
    will not go to separate prefill batches (the first request of a batch sets its kind).

    A skipped request stays in the waiting queue, like a request SGLang itself skips for another
    pooling mode; the next batch starts with it. A fused request split across chunked-prefill
    rounds counts as fused in its later rounds (it leads those batches as SGLang's chunked
    request), so only fused requests join it.
    """
    rt = service_of(adder.tree_cache)
    if shadow_of(req) is not None:
        if adder.can_run_list:  # a shadow check runs alone
            from sglang.srt.managers.schedule_policy import AddReqResult

            return AddReqResult.CONTINUE
        return in_small_rounds(adder, lambda: original(adder, req, *args, **kwargs))
    if rt is None or not adder.can_run_list:
        return original(adder, req, *args, **kwargs)
    first = adder.can_run_list[0]
    # A shadow check runs alone: batched with a user's request it would delay it.
    if (shadow_of(req) is None) != (shadow_of(first) is None) or not _fused_alike(rt, req, first):
        from sglang.srt.managers.schedule_policy import AddReqResult

        return AddReqResult.CONTINUE
    return original(adder, req, *args, **kwargs)


def _fused_alike(rt: FusionService, req: ScheduledRequest, first: ScheduledRequest) -> bool:
    """Whether admission guesses `req` and `first` alike (both fused or neither). Under TP every
    rank must batch alike: a guess one rank makes otherwise (a chunk it lost to a fault) keeps
    the request for the next batch on every rank, where it leads."""
    fuse_req, fuse_first = will_fuse(rt, req), will_fuse(rt, first)
    if rt.tp.size > 1 and not rt.tp.agree(f"{req.rid}:{fuse_req},{first.rid}:{fuse_first}"):
        return False
    return fuse_req == fuse_first


def no_storage_prefetch_for_checks(
    original: Any, scheduler: Any, req: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND hook on Scheduler._prefetch_kvcache: a shadow check loads nothing from HiCache's
    storage tier (that would move pages and count as the disk tier's hits); it computes."""
    if shadow_of(req) is not None:
        return None
    return original(scheduler, req, *args, **kwargs)


def continue_shadow_check(original: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on PrefillAdder.add_chunked_req: a shadow check's later rounds stay small too."""
    if shadow_of(req) is None:
        return original(adder, req, *args, **kwargs)
    return in_small_rounds(adder, lambda: original(adder, req, *args, **kwargs))


def forward_with_fusion(
    original: Any, runner: ModelRunnerLike, forward_batch: ExtendBatch, *args: Any, **kwargs: Any
) -> Any:
    """AROUND hook on ModelRunner._forward_raw."""
    rt = service_of(runner)
    if rt is not None and rt.auto_capture is not None:
        rt.auto_capture.before_forward()
    if rt is None or not forward_batch.forward_mode.is_extend():
        return original(runner, forward_batch, *args, **kwargs)
    if forward_batch.forward_mode.is_mixed():
        mixed = plan_mixed_batch(rt, forward_batch)
        output = original(runner, forward_batch, *args, **kwargs)
        if mixed is not None:
            _report(output.logits_output, [plan.info() if plan.asked else None for plan in mixed])
        return output
    plans = plan_batch(rt, forward_batch)
    if plans is not None and not plans_agree(rt.tp, plans):
        disagreeing = [plan for plan in plans if plan.fused]
        fall_back(rt, disagreeing, RANKS_DISAGREE)
        count_fallbacks(rt, disagreeing)
    if plans is None:  # nobody in the batch asked for fusion
        output = original(runner, forward_batch, *args, **kwargs)
        # A shadow check's rows, exact and in their prompt's context (fusion_shadow_refresh).
        keep_shadow_check_rows(rt.registry, rt.requests, runner, forward_batch)
        return output
    try:
        if all(plan.fused for plan in plans):
            adapter = rt.model.adapter(runner)
            checked = None
            if adapter is not None and rt.model.pending:
                # The gate: the normal prefill first, the same prompts fused at ratio 1 beside
                # it. A pass fuses the batch (its rows overwrite the normal prefill's slots).
                checked = original(runner, forward_batch, *args, **kwargs)
                prompts = model_check_prompts(adapter, runner, forward_batch, plans)
                if not rt.model.check(adapter, prompts, checked.logits_output.next_token_logits):
                    adapter = None
            if adapter is None:
                fall_back(rt, plans, rt.model.fallback or "no_adapter")
            else:
                try:
                    return run_fused_batch(rt, adapter, runner, forward_batch, plans)
                except CorruptChunkError as err:
                    # A streamed disk row failed its checksum before anything was written:
                    # the tier dropped the chunk, the batch is computed normally.
                    logger.error("fusion: %s; normal prefill", err)
                    fall_back(rt, plans, "chunk_unreadable")
                except RanksDisagreeError as err:  # nothing written either
                    logger.error("fusion: %s; normal prefill", err)
                    fall_back(rt, plans, RANKS_DISAGREE)
            count_fallbacks(rt, plans)  # plan_batch counted none: every plan was fused then
            if checked is not None:  # the normal prefill already ran: it is the answer
                _report(checked.logits_output, [plan.info() for plan in plans])
                return checked
        output = original(runner, forward_batch, *args, **kwargs)
        _report(output.logits_output, [plan.info() for plan in plans])
        return output
    finally:
        for plan in plans:
            plan.release(rt.registry)


def _report(logits_output: Any, infos: list[dict[str, Any] | None]) -> None:
    if logits_output is not None:
        logits_output.customized_info = {
            **(logits_output.customized_info or {}),
            META_KEY: infos,
        }
