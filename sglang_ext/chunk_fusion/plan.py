"""Per-round fusion plans of an extend batch, and the per-process state they come from.

`plan_batch` decides, for every request of a batch, whether this round is fused and, if not,
why (the fallback reason reported to the client). A batch is fused only when every request is.
`FusionRuntime.will_fuse` is admission's cheaper guess of the same decision.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections import Counter
from typing import Any

from sglang_hicache_ext.fusion.chunk import PrecomputedChunk
from sglang_hicache_ext.fusion.request import ChunkSegment, Segment, TextSegment
from sglang_hicache_ext.fusion.selectors import Selector, make_selector
from sglang_hicache_ext.sglang_ext.chunk_fusion.model_adapter import SGLangModelAdapter
from sglang_hicache_ext.sglang_ext.chunk_fusion.options import FusionOptions, parse_options
from sglang_hicache_ext.sglang_ext.chunk_fusion.registry import ChunkRegistry, registration_id
from sglang_hicache_ext.sglang_ext.server.prometheus_metrics import extension_metrics
from sglang_hicache_ext.sglang_ext.server.settings import ExtensionSettings

logger = logging.getLogger(__name__)


class FusionRuntime:
    """Per scheduler process: the chunk registry, the live requests and the counters."""

    def __init__(self, registry: ChunkRegistry, settings: ExtensionSettings) -> None:
        self.registry = registry
        self.settings = settings
        self.requests: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        # Requests seen in a partial chunked-prefill round: never fused in a later round.
        self.split_requests: weakref.WeakSet[Any] = weakref.WeakSet()
        # Admission: where the first chunk starts in each prompt (None: not fusable), recomputed
        # when the set of registered chunks changes.
        self._admission: weakref.WeakKeyDictionary[Any, tuple[int, int | None]] = (
            weakref.WeakKeyDictionary()
        )
        self.counters: Counter[str] = Counter()
        self._adapter: SGLangModelAdapter | None = None
        self._adapter_error: str | None = None

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
            options = options_of(self, req, count=False)
            first_chunk: int | None = None
            if (
                options is not None
                and options.enabled
                and registration_id(req) is None
                and _static_fallback_reason(req) is None
            ):
                matches = self.registry.index.find(req.origin_input_ids)
                first_chunk = matches[0].prompt_start if matches else None
            cached = (generation, first_chunk)
            self._admission[req] = cached
        first_chunk = cached[1]
        return (
            first_chunk is not None
            and req.prefix_len <= first_chunk
            and req not in self.split_requests
        )

    def stats(self) -> dict[str, int]:
        return dict(self.counters)


_runtime: FusionRuntime | None = None


@dataclasses.dataclass
class RequestPlan:
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


def plan_batch(rt: FusionRuntime, forward_batch: Any) -> list[RequestPlan] | None:
    """One plan per request, or None when no request of the batch asked for fusion.

    The batch is fused only if every plan is; otherwise the fused ones fall back too."""
    rids = list(forward_batch.rids or [])
    prefix_lens = list(forward_batch.extend_prefix_lens_cpu)
    extend_lens = list(forward_batch.extend_seq_lens_cpu)
    plans: list[RequestPlan] = []
    for rid, prefix_len, extend_len in zip(rids, prefix_lens, extend_lens, strict=True):
        req = rt.requests.get(rid)
        options = options_of(rt, req) if req is not None else None
        asked = options is not None and options.enabled and registration_id(req) is None
        plan = RequestPlan(req, rid, prefix_len, extend_len, asked, options)
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
            elif prefix_len > _first_chunk_start(plan.segments):
                # The tree holds exact KV over chunk tokens (an earlier normal prefill of a
                # prompt that starts the same way). The executor recomputes a prompt from its
                # start, so fusing the rest would attend to approximate copies of rows the
                # decode then reads exact: the rest is computed normally instead, exactly.
                plan.release(rt.registry)
                plan.fallback = "prefix_cached"
    if not any(plan.asked for plan in plans):
        return None
    if not all(plan.fused for plan in plans):
        # SGLang's forward computes the batch; fused plans give their chunks back.
        fall_back(rt, [plan for plan in plans if plan.fused], "mixed_batch")
    elif not _extend_tokens_agree(forward_batch, plans):
        fall_back(rt, plans, "inconsistent_batch")
        logger.error("fusion: batch tokens differ from the requests' prompts; normal prefill")
    count_fallbacks(rt, plans)
    return plans


def count_fallbacks(rt: FusionRuntime, plans: list[RequestPlan]) -> None:
    """Log and count (JSON stats and /metrics) every plan of a batch that falls back."""
    metrics = extension_metrics()
    for plan in plans:
        if plan.fallback is not None:
            rt.counters[f"fallback_{plan.fallback}"] += 1
            if metrics is not None:
                metrics.fusion_fallback(plan.fallback)
            logger.info("request %s: normal prefill (%s)", plan.rid, plan.fallback)


def fall_back(rt: FusionRuntime, plans: list[RequestPlan], reason: str) -> None:
    for plan in plans:
        plan.release(rt.registry)
        plan.fallback = reason


def options_of(rt: FusionRuntime, req: Any, count: bool = True) -> FusionOptions | None:
    try:
        return parse_options(getattr(req.sampling_params, "custom_params", None), rt.settings)
    except ValueError:  # validated at the HTTP layer; an engine API caller may bypass it
        if count:
            rt.counters["fallback_bad_options"] += 1
            if (metrics := extension_metrics()) is not None:
                metrics.fusion_fallback("bad_options")
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


def _first_chunk_start(segments: list[Segment]) -> int:
    """Prompt position of the first chunk token."""
    position = 0
    for segment in segments:
        if isinstance(segment, ChunkSegment):
            break
        position += len(segment.token_ids)
    return position


def _extend_tokens_agree(forward_batch: Any, plans: list[RequestPlan]) -> bool:
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
    metrics = extension_metrics()
    for match in registry.index.find(tokens):
        try:
            chunk = registry.store.pin(match.chunk_id)
        except KeyError:
            if metrics is not None:
                metrics.chunk_miss()
            continue
        pinned.append(match.chunk_id)
        if match.prompt_start > cursor:
            segments.append(TextSegment(tuple(tokens[cursor : match.prompt_start])))
        span = _slice(chunk, match.chunk_start, match.chunk_end)
        if metrics is not None:
            metrics.chunk_hit(span.nbytes)
        segments.append(ChunkSegment(span))
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
