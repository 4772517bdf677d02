"""Per-round fusion plans of an extend batch, from the scheduler's fusion service.

`plan_batch` decides, for every request of a batch, whether this round is fused and, if not,
why (the fallback reason reported to the client). A batch is fused only when every request is.
A fused request is computed whole in its first round; its later chunked-prefill rounds only
write the rows kept for them (`FusionService.pending`). `will_fuse` is admission's cheaper guess
of the same decision.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from sglang_hicache_ext.fusion.fused_rows import FusedRows
from sglang_hicache_ext.fusion.request import Segment
from sglang_hicache_ext.fusion.selectors import Selector, make_selector
from sglang_hicache_ext.sglang_ext.chunk_fusion.chunk_matches import (
    WholeFetches,
    chunk_positions,
    pin_request_chunks,
    prefix_agreement,
    unpin_chunks,
)
from sglang_hicache_ext.sglang_ext.chunk_fusion.placement_probe import probe_form_of
from sglang_hicache_ext.sglang_ext.chunk_fusion.registration import registration_id
from sglang_hicache_ext.sglang_ext.chunk_fusion.registry import ChunkRegistry
from sglang_hicache_ext.sglang_ext.chunk_fusion.request_options import FusionOptions
from sglang_hicache_ext.sglang_ext.chunk_fusion.service import FusionService
from sglang_hicache_ext.sglang_ext.config.setting_types import AUTO_RATIO
from sglang_hicache_ext.sglang_ext.sglang_types import ExtendBatch, ScheduledRequest
from sglang_hicache_ext.tuning.ratio.table import token_weighted_ratio

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RequestPlan:
    """How one request of an extend batch is computed in this round."""

    req: ScheduledRequest | None  # None: a request the service was not told of (never fused)
    rid: str
    prefix_len: int
    extend_len: int
    asked: bool  # the request asked for fusion
    options: FusionOptions | None = None
    segments: list[Segment] = dataclasses.field(default_factory=list)
    pinned: list[str] = dataclasses.field(default_factory=list)  # chunk ids held for the round
    chunk_tiers: dict[str, int] = dataclasses.field(default_factory=dict)  # tier -> chunks
    tuned_ratio: float | None = None  # the ratio "auto" resolved to for these chunks' tiers
    # "tuned" (the ratio table), "self_tuned" (no table) or "target" (moved from either by the
    # shadow checks toward fusion_target_agreement: ratio_start says which)
    ratio_source: str = "fixed"
    ratio_start: str | None = None
    ratio_tier: str | None = None  # with "target": the tier a check of this request moves
    tier_ratio: float | None = None  # that tier's ratio
    target_agreement: float | None = None
    tokens_by_tier: dict[str, int] = dataclasses.field(default_factory=dict)
    fetched: WholeFetches | None = None  # chunks read whole while pinning (shared tier)
    # How many chunks were computed after this prompt's own prefix, another, none (alone).
    chunk_prefixes: dict[str, int] = dataclasses.field(default_factory=dict)
    fallback: str | None = None
    probe_form: str | None = None  # a placement probe: its chunks are the probe's own copies
    # A later round of a fused request: its rows were computed in the first round.
    continuation: FusedRows | None = None

    @property
    def request(self) -> ScheduledRequest:
        """The request of a plan that asked for fusion (only those are planned further)."""
        assert self.req is not None, "a plan without its request never asks for fusion"
        return self.req

    @property
    def fused(self) -> bool:
        return (
            self.asked
            and self.fallback is None
            and (bool(self.pinned) or self.continuation is not None)
        )

    @property
    def recompute_ratio(self) -> float:
        assert self.options is not None
        if self.tuned_ratio is not None:
            return self.tuned_ratio
        assert self.options.recompute_ratio != AUTO_RATIO, "auto ratio not resolved"
        return float(self.options.recompute_ratio)

    def selector(self) -> Selector:
        assert self.options is not None
        return make_selector(
            self.options.selector,
            self.recompute_ratio,
            sink_tokens=self.options.sink_tokens,
            fresh_layers=self.options.fresh_layers,
        )

    def info(self) -> dict[str, Any] | None:
        """What the response reports for this round (None: the request did not ask)."""
        if not self.asked:
            return {"fused": False}
        return {"fused": False, "fallback": self.fallback}

    def release(self, registry: ChunkRegistry) -> None:
        unpin_chunks(registry, self.pinned, self.probe_form)
        self.pinned = []


def plan_batch(rt: FusionService, forward_batch: ExtendBatch) -> list[RequestPlan] | None:
    """One plan per request, or None when no request of the batch asked for fusion.

    The batch is fused only if every plan is; otherwise the fused ones fall back too."""
    rt.drop_finished()
    rids = list(forward_batch.rids or [])
    prefix_lens = list(forward_batch.extend_prefix_lens_cpu)
    extend_lens = list(forward_batch.extend_seq_lens_cpu)
    plans: list[RequestPlan] = []
    for rid, prefix_len, extend_len in zip(rids, prefix_lens, extend_lens, strict=True):
        req = rt.requests.get(rid)
        options = rt.options(req) if req is not None else None
        asked = options is not None and options.enabled and registration_id(req) is None
        plan = RequestPlan(req, rid, prefix_len, extend_len, asked, options)
        plans.append(plan)
        if asked:
            _plan_request(rt, plan)
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


def plan_mixed_batch(rt: FusionService, forward_batch: ExtendBatch) -> list[RequestPlan] | None:
    """Plans of a mixed batch (prefill rounds beside decoding requests, `--enable-mixed-chunk`),
    which always takes SGLang's forward: the prefill rounds that asked for fusion fall back
    (`mixed_chunk`), and a fused request part-way through its rounds is finished normally.
    None when no prefill round in it asked for fusion."""
    plans: list[RequestPlan] = []
    rows = zip(
        forward_batch.rids or [],
        forward_batch.extend_prefix_lens_cpu,
        forward_batch.extend_seq_lens_cpu,
        strict=True,
    )
    for rid, prefix_len, extend_len in rows:
        req = rt.requests.get(rid)
        options = rt.options(req) if req is not None else None
        asked = (
            req is not None
            and options is not None
            and options.enabled
            and registration_id(req) is None
            and not req.output_ids  # a decoding request's prefill is behind it
        )
        plan = RequestPlan(req, rid, prefix_len, extend_len, asked, options)
        plan.continuation = rt.pending.get(req) if req is not None and asked else None
        plans.append(plan)
    if not any(plan.asked for plan in plans):
        return None
    fall_back(rt, [plan for plan in plans if plan.asked], "mixed_chunk")
    count_fallbacks(rt, plans)
    return plans


def _plan_request(rt: FusionService, plan: RequestPlan) -> None:
    """Fill in one request's plan: a continuation, a fused first round, or a fallback."""
    req = plan.request
    rows = rt.pending.get(req)
    if rows is not None:
        if rows.start == plan.prefix_len:
            plan.continuation = rows
            return
        # Re-prefilled from another position (retracted mid-prompt): start over.
        del rt.pending[req]
    plan.fallback = _fallback_reason(rt, req)
    if plan.fallback is not None:
        return
    tokens = list(req.origin_input_ids)
    plan.probe_form = probe_form_of(req)
    if rt.auto_capture is not None:
        rt.auto_capture.settle(tokens)
    held = pin_request_chunks(rt.registry, tokens, plan.probe_form)
    plan.segments, plan.pinned, plan.chunk_tiers = held.segments, held.pinned, held.tiers
    plan.tokens_by_tier, plan.fetched = held.tokens_by_tier, held.fetched
    plan.chunk_prefixes = prefix_agreement(rt.registry, plan.pinned, tokens, held.in_context)
    spans = chunk_positions(plan.segments)
    if not plan.pinned:
        plan.fallback = "no_chunk_matched"
    elif plan.prefix_len >= spans[-1][1]:
        # Every chunk token is in the exact cached prefix: nothing is left to fuse, and the
        # normal prefill of the rest is exact and no slower.
        plan.release(rt.registry)
        plan.fallback = "prefix_cached"
    elif below_break_even(
        rt.settings.fusion_min_matched_share,
        plan.options,
        spans,
        plan.prefix_len,
        len(tokens),
    ):
        plan.release(rt.registry)
        plan.fallback = "below_break_even"
    elif plan.options is not None and plan.options.recompute_ratio == AUTO_RATIO:
        try:
            _resolve_auto_ratio(rt, plan)
        except (KeyError, ValueError) as err:  # checked at launch; a table edited since
            logger.error("fusion: no tuned ratio for request %s: %s", plan.rid, err)
            plan.release(rt.registry)
            plan.fallback = "ratio_not_tuned"


def below_break_even(
    minimum: float,
    options: FusionOptions | None,
    chunk_spans: list[tuple[int, int]],
    prefix_len: int,
    prompt_len: int,
) -> bool:
    """Whether a request whose ratio the server chooses ("auto") matches stored chunks on less
    than `minimum` (`fusion_min_matched_share`) of the tokens it would prefill (those past its
    cached prefix): below that share the fused path's own costs outweigh what reuse saves, so
    the normal prefill is the faster one. A request that pins its ratio is fused as it asks."""
    if minimum <= 0 or options is None or options.recompute_ratio != AUTO_RATIO:
        return False
    todo = prompt_len - prefix_len
    matched = sum(max(0, end - max(start, prefix_len)) for start, end in chunk_spans)
    return todo > 0 and matched < minimum * todo


def _resolve_auto_ratio(rt: FusionService, plan: RequestPlan) -> None:
    """The ratio "auto" gives a request: each chunk tier's ratio from the ratio table ("tuned")
    or this server's own measurements ("self_tuned"), the request's the token-weighted mean over
    its chunks' tiers; with a token-agreement target ("target"), each tier's ratio as the shadow
    checks moved it, never below that start. KeyError / ValueError: the table cannot serve a
    tier."""
    tokens = plan.tokens_by_tier
    if rt.settings.fusion_ratio_table:
        table = rt.ratio_table()
        plan.tuned_ratio = table.ratio_for(tokens)
        floors = {tier: table.tiers[tier].ratio for tier in tokens}
        start = None  # a tuned tier starts at its own ratio
        plan.ratio_source = "tuned"
    else:
        plan.tuned_ratio = rt.self_tuned.ratio_for(tokens)
        floors = {tier: rt.self_tuned.tier_ratio(tier) for tier in tokens}
        start = rt.self_tuned.start  # AgreementTarget keeps a tier's start at its floor or above
        plan.ratio_source = "self_tuned"
    if rt.fidelity.target is None or not tokens:
        return
    ratios = {tier: rt.fidelity.ratio(tier, floor, start) for tier, floor in floors.items()}
    total = sum(tokens.values())
    weighted = token_weighted_ratio(ratios, tokens) if total > 0 else 0.0
    plan.tuned_ratio = min(1.0, max(weighted, min(ratios.values())))
    # A check of this request moves the ratio of the tier most of its chunk tokens came from.
    plan.ratio_tier = max(tokens, key=lambda tier: tokens[tier])
    plan.tier_ratio = ratios[plan.ratio_tier]
    plan.ratio_start = plan.ratio_source
    plan.ratio_source = "target"
    plan.target_agreement = rt.fidelity.target.target


def count_fallbacks(rt: FusionService, plans: list[RequestPlan]) -> None:
    """Log and count (JSON stats and /metrics) every plan of a batch that falls back."""
    for plan in plans:
        if plan.fallback is not None:
            rt.fallback(plan.fallback)
            logger.info("request %s: normal prefill (%s)", plan.rid, plan.fallback)


def fall_back(rt: FusionService, plans: list[RequestPlan], reason: str) -> None:
    for plan in plans:
        plan.release(rt.registry)
        plan.fallback = reason
        if plan.continuation is not None:
            # Part-way through its rounds: the rest of the prompt is computed normally over
            # the fused rows already written (it never enters the tree), and never fused again.
            rt.pending.pop(plan.request, None)
            rt.interrupted.add(plan.request)
            plan.continuation = None


def will_fuse(rt: FusionService, req: ScheduledRequest) -> bool:
    """Admission's guess whether `req` will be fused; the forward-time plan decides."""
    if req in rt.pending:
        return True
    if req in rt.interrupted:
        return False
    generation = rt.registry.generation
    cached = rt.admission.get(req)
    if cached is None or cached[0] != generation:
        options = rt.options(req, count=False)
        spans: list[tuple[int, int]] = []
        if (
            options is not None
            and options.enabled
            and registration_id(req) is None
            and _static_fallback_reason(req) is None
        ):
            if rt.auto_capture is not None:  # its documents kept by earlier requests
                rt.auto_capture.settle(req.origin_input_ids)
            matches = rt.registry.find(req.origin_input_ids)
            spans = [(match.prompt_start, match.prompt_end) for match in matches]
        cached = (generation, spans, options)
        rt.admission[req] = cached
    _, spans, options = cached
    # A cached prefix is reused exactly; something is left to fuse if a chunk ends after it,
    # and enough of it to be worth fusing.
    prompt_len = len(req.origin_input_ids)
    return (
        bool(spans)
        and req.prefix_len < spans[-1][1]
        and not below_break_even(
            rt.settings.fusion_min_matched_share, options, spans, req.prefix_len, prompt_len
        )
    )


def _static_fallback_reason(req: ScheduledRequest) -> str | None:
    """Reasons known from the request alone (admission and forward agree on them)."""
    if getattr(req, "return_hidden_states", False):
        return "hidden_states_requested"
    if getattr(req, "multimodal_inputs", None) is not None:
        return "multimodal_input"
    if req.output_ids:
        # Retracted and re-prefilled with its output so far: the prompt is not the original one.
        return "resumed_request"
    return None


def _fallback_reason(rt: FusionService, req: ScheduledRequest) -> str | None:
    if req in rt.interrupted:
        return "mixed_batch"
    return _static_fallback_reason(req)


def _extend_tokens_agree(forward_batch: ExtendBatch, plans: list[RequestPlan]) -> bool:
    """The batch computes exactly each prompt's next round after its cached prefix (cheap check
    that guards the KV writes against any scheduler state this module does not know about)."""
    batch_ids = forward_batch.input_ids.tolist()
    offset = 0
    for plan in plans:
        end = plan.prefix_len + plan.extend_len
        tail = list(plan.request.origin_input_ids[plan.prefix_len : end])
        if batch_ids[offset : offset + plan.extend_len] != tail:
            return False
        offset += plan.extend_len
    return offset == len(batch_ids)
