"""Non-prefix chunk fusion inside SGLang's prefill.

Per request, `sampling_params.custom_params` (flat keys, so they survive SGLang's IPC):
  `fusion` (bool), `fusion_selector` (str), `fusion_recompute_ratio` (float in [0, 1]),
  `fusion_sink_tokens` (int >= 0: the first tokens of each chunk go first in the budget);
unset keys take the server defaults from the extension settings.

At forward time (AROUND `ModelRunner._forward_raw`), an extend batch in which every request is
fused runs through the fusion executor instead of the model's forward: chunk tokens reuse the
stored KV (RoPE re-applied at their global positions) except the selected fraction, other tokens
are computed, the resulting K/V are written to exactly the KV slots SGLang allocated for the
round, and decode then proceeds in SGLang unchanged. Fused KV is approximate, so a fused request
never inserts into the prefix tree (`skip_radix_cache_insert`): a later request must not inherit
KV that its token ids alone do not determine.

A batch is fused only when *all* its requests are: any other request (no fusion asked, a prompt
split across chunked-prefill rounds, logprobs asked, ...) is computed by SGLang's own forward,
which alone produces what it may need (input logprobs, hidden states). To keep such mixed batches
rare, admission (AROUND `PrefillAdder.add_one_req`) keeps requests that will be fused and requests
that will not in separate batches, as SGLang itself does for pooling modes. A request that asked
for fusion and gets the normal prefill is logged, counted and reported in its response
(`meta_info.hicache_ext_fusion[i].fallback`).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import torch

from sglang_hicache_ext.fusion.executor import fused_prefill
from sglang_hicache_ext.sglang_ext.chunk_fusion.model_adapter import SGLangModelAdapter
from sglang_hicache_ext.sglang_ext.chunk_fusion.options import META_KEY, parse_options
from sglang_hicache_ext.sglang_ext.chunk_fusion.plan import (
    FusionRuntime,
    RequestPlan,
    count_fallbacks,
    fall_back,
    plan_batch,
)
from sglang_hicache_ext.sglang_ext.chunk_fusion.registry import (
    REGISTER_PARAM,
    ChunkRegistry,
    registering_chunk,
)
from sglang_hicache_ext.sglang_ext.server.prometheus_metrics import (
    FusedTtftMetrics,
    extension_metrics,
)
from sglang_hicache_ext.sglang_ext.server.settings import ExtensionSettings, load_settings

logger = logging.getLogger(__name__)

_runtime: FusionRuntime | None = None


def install_runtime(registry: ChunkRegistry | None, settings: ExtensionSettings) -> None:
    global _runtime
    _runtime = FusionRuntime(registry, settings) if registry is not None else None


def runtime() -> FusionRuntime | None:
    return _runtime


# ---- hooks ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _settings_for(extra_config: str | None) -> ExtensionSettings:
    # Read once per server: the file was validated at launch and does not change while serving.
    return load_settings(extra_config)


def validate_request(tokenizer_manager: Any, obj: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook on TokenizerManager.generate_request (launching process): 400 on bad options,
    and on the internal registration key unless `POST /chunks` itself sent the request."""
    params = getattr(obj, "sampling_params", None)
    batch = params if isinstance(params, list) else [params]
    settings = _settings_for(tokenizer_manager.server_args.hicache_storage_backend_extra_config)
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
            parse_options(custom, settings)


def remember_request(req: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook on Scheduler._create_generation_req: the forward hook finds requests by rid."""
    if _runtime is not None:
        _runtime.requests[req.rid] = req
    return req


def keep_batches_homogeneous(original: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on PrefillAdder.add_one_req: requests that will be fused and requests that
    will not go to separate prefill batches (the first request of a batch sets its kind).

    A skipped request stays in the waiting queue, like a request SGLang itself skips for another
    pooling mode; the next batch starts with it. A fused request that would be split by the
    remaining chunked-prefill budget of a batch already holding others also waits: alone, it
    gets the whole budget.
    """
    rt = _runtime
    if rt is None or not adder.can_run_list:
        return original(adder, req, *args, **kwargs)
    fused = rt.will_fuse(req)
    if fused != rt.will_fuse(adder.can_run_list[0]) or (fused and _would_be_split(adder, req)):
        from sglang.srt.managers.schedule_policy import AddReqResult

        return AddReqResult.CONTINUE
    return original(adder, req, *args, **kwargs)


def _would_be_split(adder: Any, req: Any) -> bool:
    budget = adder.rem_chunk_tokens
    if budget is None:  # chunked prefill is off
        return False
    extend = len(req.full_untruncated_fill_ids) - req.prefix_len
    return adder.ceil_paged_tokens(extend) > budget


def forward_with_fusion(
    original: Any, runner: Any, forward_batch: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND hook on ModelRunner._forward_raw."""
    rt = _runtime
    if (
        rt is None
        or not forward_batch.forward_mode.is_extend()
        or forward_batch.forward_mode.is_mixed()
    ):
        return original(runner, forward_batch, *args, **kwargs)
    plans = plan_batch(rt, forward_batch)
    if plans is None:  # nobody in the batch asked for fusion
        return original(runner, forward_batch, *args, **kwargs)
    try:
        if all(plan.fused for plan in plans):
            adapter = rt.adapter(runner)
            if adapter is not None:
                return _run_fused_batch(rt, adapter, runner, forward_batch, plans)
            fall_back(rt, plans, "no_adapter")
            count_fallbacks(rt, plans)  # plan_batch counted none: every plan was fused then
        output = original(runner, forward_batch, *args, **kwargs)
        _report(output.logits_output, [plan.info() for plan in plans])
        return output
    finally:
        for plan in plans:
            plan.release(rt.registry)


_ttft_metrics: FusedTtftMetrics | None = None


def observe_fused_ttft(original: Any, manager: Any, state: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `TokenizerManager.collect_metrics` (runs only with `--enable-metrics`): when SGLang
    observes a request's TTFT and every prefill round of it was fused, observe it for fusion too."""
    global _ttft_metrics
    already_observed = state.ttft_observed
    result = original(manager, state, *args, **kwargs)
    if already_observed or not state.ttft_observed:
        return result
    rounds = state.customized_info_accumulated.get(META_KEY) or []
    if rounds and all(info and info.get("fused") for info in rounds):
        if _ttft_metrics is None:
            _ttft_metrics = FusedTtftMetrics(manager.metrics_collector.labels)
        _ttft_metrics.observe(rounds[-1]["selector"], state.time_stats.get_first_token_latency())
    return result


def _report(logits_output: Any, infos: list[dict[str, Any] | None]) -> None:
    if logits_output is not None:
        logits_output.customized_info = {
            **(logits_output.customized_info or {}),
            META_KEY: infos,
        }


def _run_fused_batch(
    rt: FusionRuntime,
    adapter: SGLangModelAdapter,
    runner: Any,
    forward_batch: Any,
    plans: list[RequestPlan],
) -> Any:
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.model_executor.model_runner import ModelRunnerOutput

    kv_pool = runner.token_to_kv_pool
    out_cache_loc = forward_batch.out_cache_loc
    logits, infos = [], []
    offset = 0
    metrics = extension_metrics()
    for plan in plans:
        began = time.perf_counter()
        result = fused_prefill(adapter, plan.segments, plan.selector(), return_kv=True)
        assert result.kv is not None
        loc = out_cache_loc[offset : offset + plan.extend_len]
        if (
            result.kv.num_tokens != plan.prefix_len + plan.extend_len
            or loc.numel() != plan.extend_len
        ):
            raise RuntimeError(
                f"fusion: request {plan.rid} computed {result.kv.num_tokens} tokens for a round of "
                f"{plan.prefix_len} cached + {plan.extend_len} new ({loc.numel()} KV slots)"
            )
        for layer in range(adapter.shape.num_layers):
            layer_id = kv_pool.start_layer + layer
            keys = result.kv.keys[layer][plan.prefix_len :]
            values = result.kv.values[layer][plan.prefix_len :]
            kv_pool.get_key_buffer(layer_id)[loc] = keys.to(kv_pool.dtype)
            kv_pool.get_value_buffer(layer_id)[loc] = values.to(kv_pool.dtype)
        if metrics is not None and loc.is_cuda:
            torch.cuda.synchronize(loc.device)  # the time of the work, not of queueing it
        prefill_s = time.perf_counter() - began
        offset += plan.extend_len
        logits.append(result.logits)
        assert plan.options is not None
        plan.req.skip_radix_cache_insert = True
        reused = result.num_chunk_tokens - int(result.selected.numel())
        recomputed = result.num_tokens - reused
        infos.append(
            {
                "fused": True,
                "selector": plan.options.selector,
                "recompute_ratio": plan.options.recompute_ratio,
                "sink_tokens": plan.options.sink_tokens,
                "chunks_hit": len(plan.pinned),
                "chunk_tokens": result.num_chunk_tokens,
                "tokens_reused": reused,
                "tokens_recomputed": recomputed,
            }
        )
        rt.counters["fused_requests"] += 1
        rt.counters["tokens_reused"] += reused
        if metrics is not None:
            options = plan.options
            metrics.fused_request(
                options.selector, options.recompute_ratio, reused, recomputed, prefill_s
            )
    output = LogitsProcessorOutput(next_token_logits=torch.stack(logits).to(runner.device))
    _report(output, infos)
    return ModelRunnerOutput(logits_output=output, can_run_graph=False)
