"""The forward of an extend batch whose every request is fused, in place of the model's.

First rounds run through the fusion executor together (`fused_prefill_batch`), each over the
exact KV that SGLang's prefix tree matched (read from the KV pool, never recomputed). The rows of
this round go to the request's `out_cache_loc` slots; the rows of its later chunked-prefill
rounds are kept (`FusedRows`) and written then, without computing anything. The logits, and
input/output logprobs when asked for, come from the model's own `LogitsProcessor` over the
final-normed hidden states of the positions it reads, so the response has SGLang's format.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from sglang_hicache_ext.fusion.decode_eviction import DEFAULT_WINDOW
from sglang_hicache_ext.fusion.executor import FusionJob, FusionResult, fused_prefill_batch
from sglang_hicache_ext.fusion.fused_rows import FusedRows, RoundRows
from sglang_hicache_ext.fusion.request import ChunkSegment, Segment
from sglang_hicache_ext.fusion.request_state import KVCache
from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.decoder import SGLangDecoderAdapter
from sglang_hicache_ext.sglang_ext.chunk_fusion.decode_keep import keep_for_decode
from sglang_hicache_ext.sglang_ext.chunk_fusion.plan import RequestPlan
from sglang_hicache_ext.sglang_ext.chunk_fusion.rank_agreement import check_selections
from sglang_hicache_ext.sglang_ext.chunk_fusion.request_options import META_KEY
from sglang_hicache_ext.sglang_ext.chunk_fusion.service import FusionService
from sglang_hicache_ext.sglang_ext.chunk_fusion.streamed_chunk import StreamedChunk

logger = logging.getLogger(__name__)


def run_fused_batch(
    rt: FusionService,
    adapter: SGLangDecoderAdapter,
    runner: Any,
    forward_batch: Any,
    plans: list[RequestPlan],
) -> Any:
    from sglang.srt.model_executor.model_runner import ModelRunnerOutput

    firsts = [(index, plan) for index, plan in enumerate(plans) if plan.continuation is None]
    began = time.perf_counter()
    jobs = [_job(adapter, runner, forward_batch, index, plan) for index, plan in firsts]
    results = fused_prefill_batch(adapter, jobs)
    check_selections(rt.tp, [result.selected for result in results])
    _synchronize(adapter.device)
    prefill_s = rt.tp.slowest(time.perf_counter() - began)
    _profile(rt, results, prefill_s)
    for (index, plan), result in zip(firsts, results, strict=True):
        plan.continuation = _rows_of(adapter, plan, result)
        if writers := rt.registry.stored_by(plan.pinned):  # found through the shared tier
            plan.continuation.info["chunks_stored_by"] = writers
        _profile_load(rt, plan, adapter.shape.num_layers)
        capacity = plan.options.decode_capacity if plan.options is not None else None
        if capacity is not None:
            row = int(forward_batch.req_pool_indices[index])
            kept = keep_for_decode(runner, plan.request, row, plan.segments, result, capacity)
            plan.continuation.info.update(kept)
            applied = "decode_kept_tokens" in kept
            rt.counters["decode_evictions" if applied else "decode_eviction_unsupported"] += 1
        _count_fused(rt, plan, plan.continuation.info, prefill_s)
    if firsts:
        logger.info(
            "fused prefill: %d request(s), %d prompt tokens, %.2f s",
            len(firsts),
            sum(result.num_tokens for result in results),
            prefill_s,
        )
        # Requests whose prefills were computed together (one matrix per layer).
        rt.counters["fused_batches"] += 1
        rt.counters["largest_fused_batch"] = max(rt.counters["largest_fused_batch"], len(firsts))

    kv_pool = runner.token_to_kv_pool
    out_cache_loc = forward_batch.out_cache_loc
    hidden = torch.zeros(
        (int(out_cache_loc.numel()), adapter.hidden_size),
        dtype=adapter.dtype,
        device=adapter.device,
    )
    infos: list[dict[str, Any] | None] = []
    offset = 0
    for index, plan in enumerate(plans):
        rows = plan.continuation
        assert rows is not None
        loc = out_cache_loc[offset : offset + plan.extend_len]
        if loc.numel() != plan.extend_len:
            raise RuntimeError(
                f"fusion: request {plan.rid} has {loc.numel()} KV slots for a round of "
                f"{plan.extend_len} tokens"
            )
        round_rows = rows.take(plan.prefix_len, plan.extend_len)
        _write(kv_pool, adapter, loc, round_rows)
        if round_rows.hidden is not None:
            start = offset + round_rows.hidden_offset
            hidden[start : start + round_rows.hidden.shape[0]] = round_rows.hidden.to(
                device=hidden.device, dtype=hidden.dtype
            )
        if rows.rounds > 1:
            rt.counters["fused_continuation_rounds"] += 1
        if rows.done:
            rt.pending.pop(plan.request, None)
            if rt.auto_capture is not None and plan.probe_form is None:
                _capture_pieces(rt, runner, forward_batch, index, plan)
        else:
            rows.keep_on_host()
            rt.pending[plan.request] = rows
        infos.append({**rows.info, "prefill_rounds": rows.rounds})
        offset += plan.extend_len
    model = runner.model
    output = model.logits_processor(forward_batch.input_ids, hidden, adapter.lm_head, forward_batch)
    output.customized_info = {**(output.customized_info or {}), META_KEY: infos}
    return ModelRunnerOutput(logits_output=output, can_run_graph=False)


def model_check_prompts(
    adapter: SGLangDecoderAdapter, runner: Any, forward_batch: Any, plans: list[RequestPlan]
) -> list[tuple[list[Segment], KVCache | None, int]]:
    """What the model check fuses of a batch SGLang prefills normally: each request's whole
    prompt over the prefix its tree matched, and the position whose logits this round of the
    normal prefill computes (its last token, or the round's last under chunked prefill)."""
    return [
        (
            plan.segments,
            _exact_prefix(adapter, runner, forward_batch, index, plan.prefix_len),
            plan.prefix_len + plan.extend_len - 1,
        )
        for index, plan in enumerate(plans)
    ]


def _job(
    adapter: SGLangDecoderAdapter, runner: Any, forward_batch: Any, index: int, plan: RequestPlan
) -> FusionJob:
    req = plan.request
    num_tokens = len(req.origin_input_ids)
    # The positions whose logits SGLang reads: the last token, and with input logprobs every
    # token from the logprob start on (the tree match never reaches past that start).
    outputs_from = num_tokens - 1
    if getattr(req, "return_logprob", False) and req.logprob_start_len >= 0:
        outputs_from = min(max(req.logprob_start_len, plan.prefix_len), num_tokens - 1)
    assert plan.options is not None
    return FusionJob(
        plan.segments,
        plan.selector(),
        exact_prefix=_exact_prefix(adapter, runner, forward_batch, index, plan.prefix_len),
        outputs_from=outputs_from,
        return_kv=True,
        overlap_loads=plan.options.overlap_loads,
        # Window scores only when the decode evicts (they cost attention of the window).
        decode_window=0 if plan.options.decode_capacity is None else DEFAULT_WINDOW,
        context_temperature=plan.options.context_temperature,
        context_scale=plan.options.context_scale,
    )


def _exact_prefix(
    adapter: SGLangDecoderAdapter, runner: Any, forward_batch: Any, index: int, prefix_len: int
) -> KVCache | None:
    """The KV of the prefix SGLang matched in its tree: rows 0..prefix_len-1 of the request's
    row in req_to_token, read from the KV pool (exact, as a normal prefill wrote them)."""
    if prefix_len == 0:
        return None
    row = forward_batch.req_pool_indices[index]
    slots = runner.req_to_token_pool.req_to_token[row, :prefix_len].to(torch.long)
    kv_pool = runner.token_to_kv_pool
    layers = range(kv_pool.start_layer, kv_pool.start_layer + adapter.shape.num_layers)
    return KVCache(
        tuple(kv_pool.get_key_buffer(layer)[slots] for layer in layers),
        tuple(kv_pool.get_value_buffer(layer)[slots] for layer in layers),
    )


def _rows_of(adapter: SGLangDecoderAdapter, plan: RequestPlan, result: FusionResult) -> FusedRows:
    """Everything the executor produced after the exact prefix, ready to hand out by round."""
    assert result.kv is not None and result.hidden is not None and plan.options is not None
    prefix_len = result.prefix_tokens
    reused = result.num_chunk_tokens - int(result.selected.numel())
    info = {
        "fused": True,
        "selector": plan.options.selector,
        "recompute_ratio": plan.recompute_ratio,
        # "auto" resolved from the ratio table ("tuned") or from this server's own
        # measurements, never below the model's quality floor ("self_tuned"), or moved from
        # either by the shadow checks toward the agreement target ("target"); else "fixed"
        "ratio_source": plan.ratio_source,
        "sink_tokens": plan.options.sink_tokens,
        "fresh_layers": plan.options.fresh_layers,
        "context_tempering": [plan.options.context_temperature, plan.options.context_scale],
        "chunks_hit": len(plan.pinned),
        "chunks_by_tier": plan.chunk_tiers,  # where each chunk's KV was loaded from
        # Which prefix each chunk was computed after, against this prompt's own start.
        "chunk_prefixes": plan.chunk_prefixes,
        "chunk_tokens": result.num_chunk_tokens,
        "prefix_tokens": prefix_len,
        "tokens_reused": reused,
        "tokens_recomputed": result.num_tokens - prefix_len - reused,
    }
    if adapter.tp.size > 1:
        # Every rank recomputed these same positions (`check_selections` compared them).
        info["tp_ranks_agree"] = adapter.tp.size
    if plan.ratio_source == "target":
        info["target_agreement"] = plan.target_agreement
        info["ratio_start"] = plan.ratio_start
        info["ratio_tier"] = plan.ratio_tier
        info["tier_ratio"] = plan.tier_ratio
    if plan.probe_form is not None:
        # A placement probe: not counted as a read, a chunk hit or a fused TTFT.
        info["probe_form"] = plan.probe_form
    streamed = [
        segment.chunk
        for segment in plan.segments
        if isinstance(segment, ChunkSegment)
        and isinstance(segment.chunk, StreamedChunk)
        and segment.chunk.from_disk
    ]
    whole = plan.fetched if plan.fetched is not None and plan.fetched.nbytes else None
    if streamed or whole is not None:
        stats = {id(chunk.stats): chunk.stats for chunk in streamed}.values()
        fetched_bytes, fetch_s = (whole.nbytes, whole.seconds) if whole is not None else (0, 0.0)
        info["load"] = {  # chunks read from lower tiers: sparse bytes vs dense, time hidden
            "bytes_read": sum(s.bytes_read for s in stats) + fetched_bytes,
            "bytes_dense": sum(chunk.dense_bytes for chunk in streamed) + fetched_bytes,
            "read_s": sum(s.read_s for s in stats) + fetch_s,
            # Chunks fetched whole while pinning wait before the compute: none of it hidden.
            "wait_s": result.load_wait_s + fetch_s,
            "overlapped": plan.options.overlap_loads and bool(streamed),
        }
    # The logits processor expects the model's output: final-normed hidden states.
    hidden = adapter.final_norm(result.hidden)
    plan.request.skip_radix_cache_insert = True  # fused KV never enters the prefix tree
    return FusedRows(
        start=prefix_len,
        end=result.num_tokens,
        keys=[k[prefix_len:] for k in result.kv.keys],
        values=[v[prefix_len:] for v in result.kv.values],
        hidden=hidden,
        hidden_start=result.num_tokens - int(hidden.shape[0]),
        info=info,
    )


def _capture_pieces(
    rt: FusionService, runner: Any, forward_batch: Any, index: int, plan: RequestPlan
) -> None:
    """auto_chunks: every row of the prompt is in the pool now; the pieces computed whole
    (no reused chunk in them) are kept."""
    assert rt.auto_capture is not None
    tokens = plan.request.origin_input_ids
    row = forward_batch.req_pool_indices[index]
    slots = runner.req_to_token_pool.req_to_token[row, : len(tokens)]
    # Once the batch's first tokens are sent (`AutoCapture.defer`).
    rt.auto_capture.defer(plan.rid, tokens, runner.token_to_kv_pool, slots, fused=True)


def _write(kv_pool: Any, adapter: SGLangDecoderAdapter, loc: torch.Tensor, rows: RoundRows) -> None:
    for layer in range(adapter.shape.num_layers):
        layer_id = kv_pool.start_layer + layer
        kv_pool.get_key_buffer(layer_id)[loc] = rows.keys[layer].to(loc.device, kv_pool.dtype)
        kv_pool.get_value_buffer(layer_id)[loc] = rows.values[layer].to(loc.device, kv_pool.dtype)


def _count_fused(
    rt: FusionService, plan: RequestPlan, info: dict[str, Any], seconds: float
) -> None:
    rt.counters["fused_requests"] += 1
    rt.counters["tokens_reused"] += info["tokens_reused"]
    rt.counters["chunk_tokens"] += info["chunk_tokens"]
    if plan.probe_form is None:
        # Prompt tokens the server did not compute: the response's cached_tokens (OpenAI's
        # usage.prompt_tokens_details) counts reused chunk rows beside the prefix-cache hit.
        plan.request.cached_tokens += info["tokens_reused"]
    rt.counters["prefix_tokens_reused"] += info["prefix_tokens"]
    metrics = rt.metrics
    if metrics is not None and plan.options is not None:
        options = plan.options
        metrics.fused_request(
            options.selector,
            plan.recompute_ratio,
            info["tokens_reused"],
            info["tokens_recomputed"],
            seconds,
        )


def _profile(rt: FusionService, results: list[FusionResult], seconds: float) -> None:
    """What "auto" learns of the compute: seconds per computed token-layer (the time the
    compute waited for rows excluded)."""
    waited = sum(result.load_wait_s for result in results)
    rt.self_tuned.record_compute(seconds - waited, sum(sum(r.computed_tokens) for r in results))


def _profile_load(rt: FusionService, plan: RequestPlan, num_layers: int) -> None:
    """What "auto" learns of a lower tier: seconds per token-layer of the rows it read."""
    assert plan.continuation is not None
    load = plan.continuation.info.get("load")
    lower = {tier: n for tier, n in plan.tokens_by_tier.items() if tier != "host"}
    if load is None or len(lower) != 1:  # one lower tier per request: its reads are its own
        return
    ((tier, tokens),) = lower.items()
    read = round(tokens * (1 - plan.recompute_ratio)) * num_layers
    rt.self_tuned.record_load(tier, rt.tp.slowest(load["read_s"]), read)


def _synchronize(device: torch.device) -> None:
    # The time of the work, not of queueing it.
    if device.type == "cuda":
        torch.cuda.synchronize(device)
