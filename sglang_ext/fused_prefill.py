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

import dataclasses
import functools
import logging
import threading
import weakref
from collections import Counter
from typing import Any

import torch

from sglang_ext.chunks import REGISTER_PARAM, ChunkRegistry, registering_chunk, registration_id
from sglang_ext.fusion.chunk import PrecomputedChunk
from sglang_ext.fusion.executor import fused_prefill
from sglang_ext.fusion.request import ChunkSegment, Segment, TextSegment
from sglang_ext.fusion.selectors import SELECTORS, Selector, make_selector
from sglang_ext.settings import ExtensionSettings, load_settings
from sglang_ext.sglang_model_adapter import SGLangModelAdapter

logger = logging.getLogger(__name__)

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


class FusionRuntime:
    """Per scheduler process: the chunk registry, the live requests and the counters."""

    def __init__(self, registry: ChunkRegistry, settings: ExtensionSettings) -> None:
        self.registry = registry
        self.settings = settings
        self.requests: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        # Requests seen in a partial chunked-prefill round: never fused in a later round.
        self.split_requests: weakref.WeakSet[Any] = weakref.WeakSet()
        # Admission: where the last chunk ends in each prompt (None: not fusable), recomputed
        # when the set of registered chunks changes.
        self._admission: weakref.WeakKeyDictionary[Any, tuple[int, int | None]] = (
            weakref.WeakKeyDictionary()
        )
        self.counters: Counter[str] = Counter()
        self._adapter: SGLangModelAdapter | None = None
        self._adapter_error: str | None = None
        self._lock = threading.Lock()

    def adapter(self, runner: Any) -> SGLangModelAdapter | None:
        if self._adapter is None and self._adapter_error is None:
            try:
                self._adapter = SGLangModelAdapter(runner.model, runner.model_config.hf_config)
            except ValueError as err:
                self._adapter_error = str(err)
                logger.error("fusion disabled: %s", err)
        return self._adapter

    def will_fuse(self, req: Any) -> bool:
        """Admission's guess whether `req` will be fused; the forward-time plan decides."""
        generation = self.registry.generation
        cached = self._admission.get(req)
        if cached is None or cached[0] != generation:
            options = _options_of(self, req, count=False)
            chunks_end: int | None = None
            if (
                options is not None
                and options.enabled
                and registration_id(req) is None
                and _static_fallback_reason(req) is None
            ):
                matches = self.registry.index.find(req.origin_input_ids)
                chunks_end = matches[-1].prompt_end if matches else None
            cached = (generation, chunks_end)
            self._admission[req] = cached
        chunks_end = cached[1]
        return (
            chunks_end is not None
            and req.prefix_len < chunks_end
            and req not in self.split_requests
        )

    def stats(self) -> dict[str, int]:
        return dict(self.counters)


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
    plans = _plan_batch(rt, forward_batch)
    if plans is None:  # nobody in the batch asked for fusion
        return original(runner, forward_batch, *args, **kwargs)
    try:
        if all(plan.fused for plan in plans):
            adapter = rt.adapter(runner)
            if adapter is not None:
                return _run_fused_batch(rt, adapter, runner, forward_batch, plans)
            _fall_back(rt, plans, "no_adapter")
        output = original(runner, forward_batch, *args, **kwargs)
        _report(output.logits_output, [plan.info() for plan in plans])
        return output
    finally:
        for plan in plans:
            plan.release(rt.registry)


@dataclasses.dataclass
class _RequestPlan:
    """How one request of an extend batch is computed in this round."""

    req: Any
    rid: str
    prefix_len: int
    extend_len: int
    asked: bool  # the request asked for fusion
    options: FusionOptions | None = None
    segments: list[Segment] = dataclasses.field(default_factory=list)
    pinned: list[str] = dataclasses.field(default_factory=list)  # chunk ids held for the round
    fallback: str | None = None

    @property
    def fused(self) -> bool:
        return self.asked and self.fallback is None and bool(self.pinned)

    def selector(self) -> Selector:
        assert self.options is not None
        return make_selector(
            self.options.selector,
            self.options.recompute_ratio,
            sink_tokens=self.options.sink_tokens,
        )

    def info(self) -> dict[str, Any] | None:
        """What the response reports for this round (None: the request did not ask)."""
        if not self.asked:
            return {"fused": False}
        return {"fused": False, "fallback": self.fallback}

    def release(self, registry: ChunkRegistry) -> None:
        for chunk_id in self.pinned:
            registry.store.unpin(chunk_id)
        self.pinned = []


def _plan_batch(rt: FusionRuntime, forward_batch: Any) -> list[_RequestPlan] | None:
    """One plan per request, or None when no request of the batch asked for fusion.

    The batch is fused only if every plan is; otherwise the fused ones fall back too."""
    rids = list(forward_batch.rids or [])
    prefix_lens = list(forward_batch.extend_prefix_lens_cpu)
    extend_lens = list(forward_batch.extend_seq_lens_cpu)
    plans: list[_RequestPlan] = []
    for rid, prefix_len, extend_len in zip(rids, prefix_lens, extend_lens, strict=True):
        req = rt.requests.get(rid)
        options = _options_of(rt, req) if req is not None else None
        asked = options is not None and options.enabled and registration_id(req) is None
        plan = _RequestPlan(req, rid, prefix_len, extend_len, asked, options)
        plans.append(plan)
        if not asked:
            continue
        plan.fallback = _fallback_reason(rt, req, prefix_len, extend_len)
        if plan.fallback is None:
            plan.segments, plan.pinned = pinned_chunk_segments(
                rt.registry, list(req.origin_input_ids)
            )
            if not plan.pinned:
                plan.fallback = "no_chunk_matched"
            elif prefix_len >= _chunks_end(plan.segments):
                # The tree already holds exact KV for every chunk token (an earlier normal
                # prefill of this prompt): nothing is left to fuse, the rest is computed exactly.
                plan.release(rt.registry)
                plan.fallback = "prefix_cached"
    if not any(plan.asked for plan in plans):
        return None
    if not all(plan.fused for plan in plans):
        # SGLang's forward computes the batch; fused plans give their chunks back.
        _fall_back(rt, [plan for plan in plans if plan.fused], "mixed_batch")
    elif not _extend_tokens_agree(forward_batch, plans):
        _fall_back(rt, plans, "inconsistent_batch")
        logger.error("fusion: batch tokens differ from the requests' prompts; normal prefill")
    for plan in plans:
        if plan.fallback is not None:
            rt.counters[f"fallback_{plan.fallback}"] += 1
            logger.info("request %s: normal prefill (%s)", plan.rid, plan.fallback)
    return plans


def _fall_back(rt: FusionRuntime, plans: list[_RequestPlan], reason: str) -> None:
    for plan in plans:
        plan.release(rt.registry)
        plan.fallback = reason


def _options_of(rt: FusionRuntime, req: Any, count: bool = True) -> FusionOptions | None:
    try:
        return parse_options(getattr(req.sampling_params, "custom_params", None), rt.settings)
    except ValueError:  # validated at the HTTP layer; an engine API caller may bypass it
        if count:
            rt.counters["fallback_bad_options"] += 1
        return None


def _static_fallback_reason(req: Any) -> str | None:
    """Reasons known from the request alone (admission and forward agree on them)."""
    if getattr(req, "return_logprob", False):
        return "logprobs_requested"
    if getattr(req, "return_hidden_states", False):
        return "hidden_states_requested"
    if getattr(req, "multimodal_inputs", None) is not None:
        return "multimodal_input"
    if req.output_ids:
        # Retracted and re-prefilled with its output so far: the prompt is not the original one.
        return "resumed_request"
    return None


def _fallback_reason(rt: FusionRuntime, req: Any, prefix_len: int, extend_len: int) -> str | None:
    reason = _static_fallback_reason(req)
    if reason is not None:
        return reason
    if req in rt.split_requests or prefix_len + extend_len != len(req.origin_input_ids):
        # Rounds before the last computed part of the prompt normally: fusing only the tail
        # would mix exact and fused KV without the selector ever seeing the whole prompt.
        rt.split_requests.add(req)
        return "split_prefill"
    return None


def _chunks_end(segments: list[Segment]) -> int:
    """Prompt position just after the last chunk token."""
    position = end = 0
    for segment in segments:
        position += (
            len(segment.token_ids) if isinstance(segment, TextSegment) else segment.chunk.num_tokens
        )
        if isinstance(segment, ChunkSegment):
            end = position
    return end


def _extend_tokens_agree(forward_batch: Any, plans: list[_RequestPlan]) -> bool:
    """The batch computes exactly each prompt's tail after its cached prefix (cheap check that
    guards the KV writes against any scheduler state this module does not know about)."""
    batch_ids = forward_batch.input_ids.tolist()
    offset = 0
    for plan in plans:
        tail = list(plan.req.origin_input_ids[plan.prefix_len :])
        if batch_ids[offset : offset + plan.extend_len] != tail:
            return False
        offset += plan.extend_len
    return offset == len(batch_ids)


def pinned_chunk_segments(
    registry: ChunkRegistry, tokens: list[int]
) -> tuple[list[Segment], list[str]]:
    """The prompt as text and chunk segments, with the matched chunks pinned (callers unpin).

    A chunk evicted or deleted since matching is skipped: its tokens are computed like text."""
    segments: list[Segment] = []
    pinned: list[str] = []
    cursor = 0
    for match in registry.index.find(tokens):
        try:
            chunk = registry.store.pin(match.chunk_id)
        except KeyError:
            continue
        pinned.append(match.chunk_id)
        if match.prompt_start > cursor:
            segments.append(TextSegment(tuple(tokens[cursor : match.prompt_start])))
        segments.append(ChunkSegment(_slice(chunk, match.chunk_start, match.chunk_end)))
        cursor = match.prompt_end
    if cursor < len(tokens):
        segments.append(TextSegment(tuple(tokens[cursor:])))
    return segments, pinned


def _slice(chunk: PrecomputedChunk, start: int, end: int) -> PrecomputedChunk:
    if (start, end) == (0, chunk.num_tokens):
        return chunk
    return PrecomputedChunk(
        token_ids=chunk.token_ids[start:end],
        keys=tuple(k[start:end] for k in chunk.keys),
        values=tuple(v[start:end] for v in chunk.values),
        freq_scores=chunk.freq_scores[:, start:end],
        alpha=chunk.alpha,
    )


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
    plans: list[_RequestPlan],
) -> Any:
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.model_executor.model_runner import ModelRunnerOutput

    kv_pool = runner.token_to_kv_pool
    out_cache_loc = forward_batch.out_cache_loc
    logits, infos = [], []
    offset = 0
    for plan in plans:
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
        offset += plan.extend_len
        logits.append(result.logits)
        assert plan.options is not None
        plan.req.skip_radix_cache_insert = True
        reused = result.num_chunk_tokens - int(result.selected.numel())
        infos.append(
            {
                "fused": True,
                "selector": plan.options.selector,
                "recompute_ratio": plan.options.recompute_ratio,
                "sink_tokens": plan.options.sink_tokens,
                "chunks_hit": len(plan.pinned),
                "chunk_tokens": result.num_chunk_tokens,
                "tokens_reused": reused,
                "tokens_recomputed": result.num_tokens - reused,
            }
        )
        rt.counters["fused_requests"] += 1
        rt.counters["tokens_reused"] += reused
    output = LogitsProcessorOutput(next_token_logits=torch.stack(logits).to(runner.device))
    _report(output, infos)
    return ModelRunnerOutput(logits_output=output, can_run_graph=False)
