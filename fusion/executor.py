"""Layer-by-layer fused prefill: reuse chunk KV at global positions, recompute a selection.

Per layer the request KV [N, Hkv, D] is assembled from the exact prefix (if any), the stored
chunk KV (keys rotated to their global positions) and the freshly computed K/V; queries exist
only for the tokens computed at that layer and attend over the whole request KV by position.
Which tokens those are is `request_state.RequestState`'s business. Several requests go through
each layer together: their computed tokens form one matrix for the projections, norms and MLP,
and attention runs per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from sglang_hicache_ext.fusion.adapter import ModelAdapter
from sglang_hicache_ext.fusion.attention import attend, tempered_context_attention
from sglang_hicache_ext.fusion.decode_eviction import window_scores
from sglang_hicache_ext.fusion.fidelity_signals import (
    SIGNAL_LAYERS,
    first_token_signals,
    prompt_shape,
    question_mass,
)
from sglang_hicache_ext.fusion.request import Segment, question_over_chunks
from sglang_hicache_ext.fusion.request_state import FusionJob, KVCache, RequestState
from sglang_hicache_ext.fusion.selectors import (
    CheckLayerState,
    ReuseSelector,
    Selector,
)


@dataclass(frozen=True, eq=False)
class FusionResult:
    """Outcome of a fused prefill.

    logits: float32 [vocab] of the last request token. selected: sorted global positions of the
    chunk tokens recomputed after the check layer. computed_tokens[l]: tokens whose q/k/v were
    projected at layer l (at the check layer all of them; only the selection goes on to attention).
    num_chunk_tokens: chunk tokens after the exact prefix (those the selector chose from).
    kv: the request KV (for decoding) when asked for. hidden: the last layer's output (the
    residual stream before the final norm) of positions `outputs_from`..N-1, when asked for.
    """

    logits: torch.Tensor
    selected: torch.Tensor
    computed_tokens: tuple[int, ...]
    num_tokens: int
    num_chunk_tokens: int
    kv: KVCache | None = None
    hidden: torch.Tensor | None = None
    prefix_tokens: int = 0
    load_wait_s: float = 0.0  # time the compute waited for stored rows of slow-tier chunks
    # [L, Hkv, N]: what each token received from the last prompt queries (job.decode_window),
    # the scores a decode-time eviction ranks by (`fusion.decode_eviction`).
    window_scores: torch.Tensor | None = None
    # With job.record_signals: what the prefill tells about its own fidelity (`fidelity_signals`).
    signals: dict[str, float] | None = None


@torch.inference_mode()
def fused_prefill(
    adapter: ModelAdapter,
    segments: Sequence[Segment],
    selector: Selector,
    *,
    return_kv: bool = False,
    attention_backend: str = "torch",
    exact_prefix: KVCache | None = None,
    outputs_from: int | None = None,
    decode_window: int = 0,
    context_tempering: tuple[float, float] = (1.0, 1.0),
) -> FusionResult:
    """Prefill `segments` reusing chunk KV, recomputing what `selector` picks (see FusionJob);
    `context_tempering` is the question's (temperature, scale) over the chunks."""
    temperature, scale = context_tempering
    job = FusionJob(
        segments,
        selector,
        exact_prefix,
        outputs_from,
        return_kv,
        decode_window=decode_window,
        context_temperature=temperature,
        context_scale=scale,
    )
    return fused_prefill_batch(adapter, [job], attention_backend=attention_backend)[0]


@torch.inference_mode()
def fused_prefill_batch(
    adapter: ModelAdapter, jobs: Sequence[FusionJob], *, attention_backend: str = "torch"
) -> list[FusionResult]:
    """Several fused prefills at once: per layer, the computed tokens of every request go through
    the projections, norms and MLP as one matrix; attention and selection stay per request."""
    if not jobs:
        return []
    states = [RequestState(adapter, job) for job in jobs]
    try:
        scored = [state for state in states if state.scoring_layers]
        if scored:
            _scoring_pass(adapter, scored, attention_backend)
        return _run_layers(adapter, states, attention_backend)
    finally:
        for state in states:
            state.loader.close()


def _scoring_pass(
    adapter: ModelAdapter, states: list[RequestState], attention_backend: str
) -> None:
    """The question over the reused KV (no chunk token computed), up to the last scoring layer:
    its attention to each chunk token at the scoring layers, summed, becomes each state's
    selection (ProphetKV's first pass). The pass reads the chunks, the question and the exact
    prefix only (`question_over_chunks`, unless the selector asks for the whole prompt): the
    prompt's other new text, which the prefill computes at every layer anyway, would cost as
    much again here. Costs about a pure-reuse prefill of those layers over the question's last
    tokens, as many as the request's reuse affords (`Selector.scoring_question_read`)."""
    scoring_segments = [
        None
        if state.selector.scoring_reads_whole_prompt
        else question_over_chunks(state.layout, state.prefix_len, state.scoring_question_tokens)
        for state in states
    ]
    passes = [
        RequestState(
            adapter,
            replace(
                state.job,
                segments=state.job.segments if segments is None else segments,
                selector=ReuseSelector(),
                outputs_from=None,
                return_kv=False,
                decode_window=0,
                record_layers=state.scoring_layers,
                record_signals=False,
            ),
            # Rows of slow-tier chunks read here serve the prefill too (read once, not twice).
            loader=state.loader,
        )
        for state, segments in zip(states, scoring_segments, strict=True)
    ]
    for state, scoring, segments in zip(states, passes, scoring_segments, strict=True):
        state.loader.retain = True
        if state.job.return_kv and state.narrow_layer is None and segments is None:
            # The prefill reuses the same rows at these layers: it takes each layer's assembled
            # K/V and writes only the rows it computes (no second load and re-rotation). Kept
            # only when the prefill returns its KV, which these tensors become (no higher peak),
            # and when the pass read the whole prompt (the same positions).
            scoring.kv_out = state.kv_in = {}
    try:
        _walk_layers(adapter, passes, attention_backend, max(max(s.scoring_layers) for s in states))
    finally:
        for state in states:
            state.loader.retain = False
    for state, scoring in zip(states, passes, strict=True):
        assert scoring.question_attention is not None
        state.apply_scores(scoring.question_attention)
        if state.job.record_signals:
            total = float(scoring.question_rows)
            state.signals.update(
                question_mass(scoring.question_attention, state.layout.spans, total)
            )


def _run_layers(
    adapter: ModelAdapter, states: list[RequestState], attention_backend: str
) -> list[FusionResult]:
    hidden = _walk_layers(adapter, states, attention_backend, adapter.shape.num_layers - 1)
    finals = hidden.split([state.num_active for state in states])
    logits = adapter.logits(_cat([final[-1:] for final in finals])).float()
    return [
        FusionResult(
            logits=logits[i],
            selected=state.selected,
            computed_tokens=tuple(state.computed),
            num_tokens=state.num_tokens,
            num_chunk_tokens=state.layout.num_chunk_tokens,
            kv=KVCache(tuple(state.keys), tuple(state.values)) if state.job.return_kv else None,
            hidden=state.outputs(final),
            prefix_tokens=state.prefix_len,
            load_wait_s=state.loader.wait_s,
            window_scores=torch.stack(state.window_scores) if state.window_scores else None,
            signals={
                **prompt_shape(state.layout),
                **state.signals,
                **first_token_signals(logits[i]),
            }
            if state.job.record_signals
            else None,
        )
        for i, (state, final) in enumerate(zip(states, finals, strict=True))
    ]


def _walk_layers(
    adapter: ModelAdapter, states: list[RequestState], attention_backend: str, last_layer: int
) -> torch.Tensor:
    """Layers 0..last_layer; returns the active rows' hidden states after the last."""
    hidden = adapter.embed(_cat([state.active_token_ids() for state in states]))
    for layer in range(last_layer + 1):
        for state in states:  # this layer's rows if not yet asked for, and the next layer's
            state.prefetch(layer)
            if layer < last_layer:  # a scoring pass stops early: read nothing past it
                state.prefetch(layer + 1)
        q, k, v = adapter.attention_inputs(layer, hidden)
        sizes = [state.num_active for state in states]
        if layer in SIGNAL_LAYERS:
            for state, k_rows, v_rows in zip(states, k.split(sizes), v.split(sizes), strict=True):
                if state.job.record_signals:
                    state.note_kv_deviation(layer, k_rows, v_rows)
        q_pos = _cat([state.q_pos for state in states])
        q, k = adapter.rotate(q, q_pos, layer), adapter.rotate(k, q_pos, layer)
        kept, attended = [], []
        for state, *rows in zip(
            states, hidden.split(sizes), q.split(sizes), k.split(sizes), v.split(sizes), strict=True
        ):
            state.computed.append(int(rows[0].shape[0]))
            rows_kept, attn = _attend_request(adapter, state, layer, *rows, attention_backend)
            kept.append(rows_kept)
            attended.append(attn)
        hidden = adapter.attention_output(layer, _cat(kept), _cat(attended))
    return hidden


def _attend_request(
    adapter: ModelAdapter,
    state: RequestState,
    layer: int,
    hidden: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's attention at `layer`: at its check layer the selector chooses, at its
    narrowing layer the rows narrow to the selection. Returns the hidden rows that go on and
    their attention output."""
    kind = adapter.layers[layer]
    prefix_k, prefix_v = state.prefix_kv(layer, k.dtype)
    if layer == state.check_layer:
        # Every token after the prefix was computed up to here, in position order.
        layer_k, layer_v = _after(prefix_k, k), _after(prefix_v, v)
        reused = _load_reused(adapter, state, layer, state.load_plan(layer))
        # Selectors index queries by global position; cached prefix rows have none (zeros).
        queries = _after(
            None if prefix_k is None else q.new_zeros((state.prefix_len, *q.shape[1:])), q
        )
        check = CheckLayerState(
            layer, queries, layer_k, layer_v, reused.keys, reused.values, adapter.attn_scale
        )
        state.select_at_check_layer(check, q)
    elif layer == state.narrow_layer:
        layer_k, layer_v = _after(prefix_k, k), _after(prefix_v, v)  # every token still fresh
    if layer == state.narrow_layer:
        keep = state.narrow(state.selected)
        state.prefetch(layer + 1)  # the selection is known: start reading what follows
        q, hidden = q[keep], hidden[keep]
    elif (handed := state.kv_in.pop(layer, None)) is not None:
        # The scoring pass assembled this layer from the same prefix and reused rows: only
        # the rows computed now differ (every one of them is overwritten).
        layer_k, layer_v = handed
        layer_k[state.active_idx] = k
        layer_v[state.active_idx] = v
    elif layer != state.check_layer:
        reused = _load_reused(adapter, state, layer, state.plan)
        layer_k, layer_v = _assemble(
            reused, k, v, state.active_idx, state.num_tokens, prefix_k, prefix_v
        )
    if state.kv_out is not None:
        state.kv_out[layer] = (layer_k, layer_v)
    if layer in state.record_layers and layer != state.check_layer:
        state.record_question_attention(q, layer_k, adapter.attn_scale)
    attn = attend(
        q,
        layer_k,
        layer_v,
        state.q_pos,
        state.positions,
        adapter.attn_scale,
        attention_backend,
        causal=state.causal,
        host_positions=state.q_pos_host,
        window=kind.sliding_window,
        logit_cap=kind.logit_cap,
    )
    if state.job.tempered:
        question = state.layout.is_question.to(q.device)[state.active_idx]
        attn[question] = tempered_context_attention(
            q[question],
            layer_k,
            layer_v,
            state.q_pos[question],
            state.layout.is_chunk.to(q.device),
            adapter.attn_scale,
            state.job.context_temperature,
            state.job.context_scale,
            kind.sliding_window,
        ).to(attn.dtype)
    if state.job.decode_window:
        # The window's queries computed at this layer (the question's always are).
        window = state.q_pos >= state.num_tokens - state.job.decode_window
        state.window_scores.append(
            window_scores(q[window], state.q_pos[window], layer_k, adapter.attn_scale)
        )
    if state.job.return_kv:
        state.keys.append(layer_k)
        state.values.append(layer_v)
    return hidden, attn


def _cat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    # One request: no copy, so a lone prefill runs exactly the operations it always did.
    return parts[0] if len(parts) == 1 else torch.cat(list(parts))


def _after(prefix: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    return rows if prefix is None else torch.cat((prefix, rows))


class _Reused(NamedTuple):
    """Stored chunk KV of one layer for some tokens: keys rotated to their global positions."""

    positions: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor


def _load_reused(
    adapter: ModelAdapter, state: RequestState, layer: int, plan: list[torch.Tensor]
) -> _Reused:
    """Gather only the planned rows (a sparse load when chunks live in another tier)."""
    device, dtype = adapter.device, adapter.dtype
    keys, values = [], []
    on_device: list[torch.Tensor] | None = None
    for index, (span, rows) in enumerate(zip(state.layout.spans, plan, strict=True)):
        if rows.numel() == 0:
            continue
        # Each chunk gets its row indices where it indexes: a chunk held on the GPU the plan's
        # copy there (made once per plan), one in host memory or on disk the host-side plan.
        where = rows
        if span.chunk.index_device == device and device.type != "cpu":
            on_device = state.on_device(plan) if on_device is None else on_device
            where = on_device[index]
        stored_k, stored_v = state.loader.get(layer, index, span.chunk, where)
        keys.append(stored_k.to(device=device, dtype=dtype))
        values.append(stored_v.to(device=device, dtype=dtype))
    if not keys:
        shape = (0, adapter.shape.num_kv_heads, adapter.shape.head_dim)
        empty = torch.empty(shape, device=device, dtype=dtype)
        return _Reused(torch.empty(0, dtype=torch.long, device=device), empty, empty)
    global_positions = state.plan_positions(plan)
    rotated = adapter.rotate(torch.cat(keys), global_positions, layer)
    return _Reused(global_positions, rotated, torch.cat(values))


def _assemble(
    reused: _Reused,
    k: torch.Tensor,
    v: torch.Tensor,
    active_idx: torch.Tensor,
    num_tokens: int,
    prefix_k: torch.Tensor | None = None,
    prefix_v: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Request KV [N, Hkv, D]: exact prefix rows, reused rows and computed rows, each at its
    position."""
    prefix_len = 0 if prefix_k is None else int(prefix_k.shape[0])
    if active_idx.numel() == num_tokens - prefix_len:
        # Every token after the prefix computed this layer, in position order: nothing to scatter.
        return _after(prefix_k, k), _after(prefix_v, v)
    layer_k = k.new_empty((num_tokens, *k.shape[1:]))
    layer_v = v.new_empty((num_tokens, *v.shape[1:]))
    if prefix_k is not None and prefix_v is not None:
        layer_k[:prefix_len] = prefix_k
        layer_v[:prefix_len] = prefix_v
    layer_k[reused.positions] = reused.keys
    layer_v[reused.positions] = reused.values
    layer_k[active_idx] = k
    layer_v[active_idx] = v
    return layer_k, layer_v


__all__ = [
    "FusionJob",
    "FusionResult",
    "KVCache",
    "fused_prefill",
    "fused_prefill_batch",
]
