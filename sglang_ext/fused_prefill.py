"""Non-prefix chunk fusion inside SGLang's prefill.

Per request, `sampling_params.custom_params` (flat keys, so they survive SGLang's IPC):
  `fusion` (bool), `fusion_selector` (str), `fusion_recompute_ratio` (float in [0, 1]),
  `fusion_sink_tokens` (int >= 0: the first tokens of each chunk go first in the budget);
unset keys take the server defaults from the extension settings.

At forward time (AROUND `ModelRunner._forward_raw`), an extend batch in which a request asks
for fusion and its prompt contains registered chunks runs through the fusion executor instead
of the model's forward: chunk tokens reuse the stored KV (RoPE re-applied at their global
positions) except the selected fraction, other tokens are computed, the resulting K/V are
written to the request's KV slots, and decode then proceeds in SGLang unchanged. Other
requests of the same batch are computed in full by the same executor (exact), so mixed
batches work. Fused KV is approximate, so a fused request never inserts into the prefix tree
(`skip_radix_cache_insert`): a later request must not inherit KV that its token ids alone do
not determine.

A request falls back to the normal prefill, logged and counted, when its prompt arrives in
several chunked-prefill rounds, when it asks for input logprobs, or when no chunk matches.
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

from sglang_ext.chunks import ChunkRegistry, registration_id
from sglang_ext.fusion.adapter import AttentionInputs, ModelAdapter
from sglang_ext.fusion.chunk import ModelShape, PrecomputedChunk
from sglang_ext.fusion.executor import fused_prefill
from sglang_ext.fusion.request import ChunkSegment, Segment, TextSegment
from sglang_ext.fusion.rope import rope_spec_from_config
from sglang_ext.fusion.selectors import SELECTORS, Selector, make_selector
from sglang_ext.settings import ExtensionSettings, load_settings

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
    """Options of one request; ValueError (HTTP 400) for malformed ones."""
    params = custom_params or {}
    if not isinstance(params, dict):
        raise ValueError("sampling_params.custom_params must be an object")
    enabled = params.get(ENABLE_KEY, defaults.fusion_by_default)
    selector = params.get(SELECTOR_KEY, defaults.fusion_selector)
    ratio = params.get(RATIO_KEY, defaults.fusion_recompute_ratio)
    sink_tokens = params.get(SINK_KEY, defaults.fusion_sink_tokens)
    if not isinstance(enabled, bool):
        raise ValueError(f"custom_params.{ENABLE_KEY} must be true or false, got {enabled!r}")
    if selector not in SELECTORS:
        raise ValueError(
            f"custom_params.{SELECTOR_KEY} = {selector!r} is unknown; choose from {sorted(SELECTORS)}"
        )
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0.0 <= ratio <= 1.0:
        raise ValueError(f"custom_params.{RATIO_KEY} must be a number in [0, 1], got {ratio!r}")
    if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or sink_tokens < 0:
        raise ValueError(f"custom_params.{SINK_KEY} must be an integer >= 0, got {sink_tokens!r}")
    return FusionOptions(enabled, selector, float(ratio), sink_tokens)


class SGLangModelAdapter(ModelAdapter):
    """SGLang's Llama / Qwen2 modules split at the attention op (TP=1)."""

    SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM")

    def __init__(self, model: Any, hf_config: Any) -> None:
        if type(model).__name__ not in self.SUPPORTED:
            raise ValueError(
                f"fusion has no adapter for {type(model).__name__}; supported: {', '.join(self.SUPPORTED)}"
            )
        self._model = model
        self._layers = model.model.layers
        attn = self._layers[0].self_attn
        self.shape = ModelShape(
            num_layers=len(self._layers),
            num_q_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
        )
        self.rope_spec = rope_spec_from_config(hf_config)
        self.attn_scale = float(attn.scaling)
        weight = model.model.embed_tokens.weight
        self._device, self._dtype = weight.device, weight.dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._model.model.embed_tokens(token_ids)

    def attention_inputs(self, layer: int, hidden: torch.Tensor) -> AttentionInputs:
        block = self._layers[layer]
        attn = block.self_attn
        qkv, _ = attn.qkv_proj(block.input_layernorm(hidden))
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        n, dim = hidden.shape[0], self.shape.head_dim
        return AttentionInputs(q.view(n, -1, dim), k.view(n, -1, dim), v.view(n, -1, dim))

    def attention_output(
        self, layer: int, hidden: torch.Tensor, attn: torch.Tensor
    ) -> torch.Tensor:
        block = self._layers[layer]
        out, _ = block.self_attn.o_proj(attn.reshape(attn.shape[0], -1))
        hidden = hidden + out
        return hidden + block.mlp(block.post_attention_layernorm(hidden))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = self._model.model.norm(hidden)
        return (normed @ self._model.lm_head.weight.t()).float()


class FusionRuntime:
    """Per scheduler process: the chunk registry, the live requests and the counters."""

    def __init__(self, registry: ChunkRegistry, settings: ExtensionSettings) -> None:
        self.registry = registry
        self.settings = settings
        self.requests: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
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
    """BEFORE hook on TokenizerManager.generate_request (launching process): 400 on bad options."""
    params = getattr(obj, "sampling_params", None)
    batch = params if isinstance(params, list) else [params]
    settings = _settings_for(tokenizer_manager.server_args.hicache_storage_backend_extra_config)
    for sampling in batch:
        if isinstance(sampling, dict):
            parse_options(sampling.get("custom_params"), settings)


def remember_request(req: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook on Scheduler._create_generation_req: the forward hook finds requests by rid."""
    if _runtime is not None:
        _runtime.requests[req.rid] = req
    return req


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
    if plans is None:
        return original(runner, forward_batch, *args, **kwargs)
    adapter = rt.adapter(runner)
    if adapter is None:
        rt.counters["fallback_no_adapter"] += len(plans)
        return original(runner, forward_batch, *args, **kwargs)
    return _run_fused_batch(rt, runner, adapter, forward_batch, plans)


@dataclasses.dataclass
class _RequestPlan:
    req: Any
    prefix_len: int
    extend_len: int
    segments: list[Segment]
    # The request's options when it is fused; None: computed in full (exact) by the executor.
    fusion: FusionOptions | None = None
    chunks_hit: int = 0

    def selector(self) -> Selector:
        if self.fusion is None:
            return make_selector("full", 1.0)
        options = self.fusion
        return make_selector(
            options.selector, options.recompute_ratio, sink_tokens=options.sink_tokens
        )


def _plan_batch(rt: FusionRuntime, forward_batch: Any) -> list[_RequestPlan] | None:
    """Plans for every request, or None when the batch goes the normal way."""
    rids = list(forward_batch.rids or [])
    prefix_lens = list(forward_batch.extend_prefix_lens_cpu)
    extend_lens = list(forward_batch.extend_seq_lens_cpu)
    plans: list[_RequestPlan] = []
    any_fused = False
    for rid, prefix_len, extend_len in zip(rids, prefix_lens, extend_lens, strict=True):
        req = rt.requests.get(rid)
        if req is None:
            return None
        options = _options_of(rt, req)
        tokens = list(req.origin_input_ids)
        plan = _RequestPlan(req, prefix_len, extend_len, [TextSegment(tuple(tokens))])
        if options is not None and options.enabled and registration_id(req) is None:
            reason = _fallback_reason(req, prefix_len, extend_len, len(tokens))
            if reason is None:
                segments, hits = _segments(rt.registry, tokens)
                if hits:
                    plan = _RequestPlan(req, prefix_len, extend_len, segments, options, hits)
                    any_fused = True
                else:
                    reason = "no_chunk_matched"
            if reason is not None:
                rt.counters[f"fallback_{reason}"] += 1
                logger.info("request %s: normal prefill (%s)", rid, reason)
        plans.append(plan)
    return plans if any_fused else None


def _options_of(rt: FusionRuntime, req: Any) -> FusionOptions | None:
    try:
        return parse_options(getattr(req.sampling_params, "custom_params", None), rt.settings)
    except ValueError:  # validated at the HTTP layer; an engine API caller may bypass it
        rt.counters["fallback_bad_options"] += 1
        return None


def _fallback_reason(req: Any, prefix_len: int, extend_len: int, prompt_len: int) -> str | None:
    if prefix_len + extend_len != prompt_len:
        return "split_prefill"
    if getattr(req, "return_logprob", False):
        return "logprobs_requested"
    return None


def _segments(registry: ChunkRegistry, tokens: list[int]) -> tuple[list[Segment], int]:
    segments: list[Segment] = []
    cursor = 0
    hits = 0
    for match in registry.index.find(tokens):
        # A hit refreshes the chunk's LRU position; an entry evicted since matching is skipped
        # (its tokens are then computed like any text).
        chunk = registry.store.get(match.chunk_id)
        if chunk is None:
            continue
        if match.prompt_start > cursor:
            segments.append(TextSegment(tuple(tokens[cursor : match.prompt_start])))
        segments.append(ChunkSegment(_slice(chunk, match.chunk_start, match.chunk_end)))
        cursor = match.prompt_end
        hits += 1
    if cursor < len(tokens):
        segments.append(TextSegment(tuple(tokens[cursor:])))
    return segments, hits


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


def _run_fused_batch(
    rt: FusionRuntime,
    runner: Any,
    adapter: SGLangModelAdapter,
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
        for layer in range(adapter.shape.num_layers):
            layer_id = kv_pool.start_layer + layer
            kv_pool.get_key_buffer(layer_id)[loc] = result.kv.keys[layer][plan.prefix_len :].to(
                kv_pool.dtype
            )
            kv_pool.get_value_buffer(layer_id)[loc] = result.kv.values[layer][plan.prefix_len :].to(
                kv_pool.dtype
            )
        offset += plan.extend_len
        logits.append(result.logits)
        info: dict[str, Any] = {"fused": plan.fusion is not None}
        if plan.fusion is not None:
            plan.req.skip_radix_cache_insert = True
            reused = result.num_chunk_tokens - int(result.selected.numel())
            info.update(
                selector=plan.fusion.selector,
                recompute_ratio=plan.fusion.recompute_ratio,
                sink_tokens=plan.fusion.sink_tokens,
                chunks_hit=plan.chunks_hit,
                chunk_tokens=result.num_chunk_tokens,
                tokens_reused=reused,
                tokens_recomputed=result.num_tokens - reused,
            )
            rt.counters["fused_requests"] += 1
            rt.counters["tokens_reused"] += reused
        infos.append(info)
    output = LogitsProcessorOutput(next_token_logits=torch.stack(logits).to(runner.device))
    output.customized_info = {META_KEY: infos}
    return ModelRunnerOutput(logits_output=output, can_run_graph=False)
