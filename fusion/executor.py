"""Layer-by-layer fused prefill: reuse chunk KV at global positions, recompute a selection.

Per layer the request KV [N, Hkv, D] is assembled from the stored chunk KV (keys rotated to their
global positions) with the freshly computed K/V scattered over it; queries exist only for the
tokens computed at that layer and attend over the whole request KV by position. Tokens outside
chunks and the last token are always computed; chunk tokens are computed up to and including
the selector's check layer (if any), then only the selected ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from sglang_hicache_ext.fusion.adapter import ModelAdapter
from sglang_hicache_ext.fusion.attention import attend
from sglang_hicache_ext.fusion.chunk import PrecomputedChunk
from sglang_hicache_ext.fusion.frequency import DEFAULT_ALPHA, frequency_scores
from sglang_hicache_ext.fusion.request import RequestLayout, Segment, build_layout
from sglang_hicache_ext.fusion.selectors import CheckLayerState, SelectionContext, Selector


@dataclass(frozen=True, eq=False)
class KVCache:
    """Post-RoPE K and V of every layer for tokens at positions 0..num_tokens-1."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.keys[0].shape[0])


@dataclass(frozen=True, eq=False)
class FusionResult:
    """Outcome of a fused prefill.

    logits: float32 [vocab] of the last request token. selected: sorted global positions of the
    chunk tokens recomputed after the check layer. computed_tokens[l]: tokens whose q/k/v were
    projected at layer l (at the check layer all of them; only the selection goes on to attention).
    kv: the request KV (for decoding) when asked for.
    """

    logits: torch.Tensor
    selected: torch.Tensor
    computed_tokens: tuple[int, ...]
    num_tokens: int
    num_chunk_tokens: int
    kv: KVCache | None = None


@dataclass(frozen=True, eq=False)
class GenerationResult:
    """Greedy continuation after a fused prefill; first_logits are the prefill's logits."""

    token_ids: tuple[int, ...]
    first_logits: torch.Tensor
    prefill: FusionResult


@torch.inference_mode()
def precompute_chunk(
    adapter: ModelAdapter, token_ids: Sequence[int], alpha: float = DEFAULT_ALPHA
) -> PrecomputedChunk:
    """Prefill a chunk alone at positions 0..n-1; keep pre-RoPE K, V and frequency scores."""
    ids = tuple(int(t) for t in token_ids)
    if not ids:
        raise ValueError("cannot precompute an empty chunk")
    device = adapter.device
    positions = torch.arange(len(ids), device=device)
    hidden = adapter.embed(torch.tensor(ids, device=device))
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for layer in range(adapter.shape.num_layers):
        q, k, v = adapter.attention_inputs(layer, hidden)
        keys.append(k.contiguous())
        values.append(v.contiguous())
        q, k = adapter.rotate(q, positions), adapter.rotate(k, positions)
        attn = attend(q, k, v, positions, positions, adapter.attn_scale)
        hidden = adapter.attention_output(layer, hidden, attn)
    scores = torch.stack([frequency_scores(k, v, alpha) for k, v in zip(keys, values, strict=True)])
    return PrecomputedChunk(
        token_ids=ids, keys=tuple(keys), values=tuple(values), freq_scores=scores, alpha=alpha
    )


@torch.inference_mode()
def fused_prefill(
    adapter: ModelAdapter,
    segments: Sequence[Segment],
    selector: Selector,
    *,
    return_kv: bool = False,
    attention_backend: str = "torch",
) -> FusionResult:
    """Prefill `segments` reusing chunk KV, recomputing what `selector` picks."""
    layout = build_layout(list(segments))
    _check_request(adapter, layout, selector)
    device = adapter.device
    num_tokens = layout.num_tokens
    positions = torch.arange(num_tokens, device=device)
    always = ~layout.is_chunk
    # The next-token logits come from the last token, so it is computed even inside a chunk.
    always[-1] = True
    check_layer = selector.check_layer

    selected = layout.chunk_positions[:0]
    if check_layer is None:
        selected = selector.select(SelectionContext(layout))
        active = _with_selected(always, selected)
    else:
        active = torch.ones(num_tokens, dtype=torch.bool)
    active_idx = torch.nonzero(active).flatten().to(device)

    hidden = adapter.embed(layout.token_ids.to(device)[active_idx])
    plan = _reuse_plan(layout, active)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    computed: list[int] = []
    for layer in range(adapter.shape.num_layers):
        q, k, v = adapter.attention_inputs(layer, hidden)
        q_pos = positions[active_idx]
        q, k = adapter.rotate(q, q_pos), adapter.rotate(k, q_pos)
        computed.append(int(active_idx.numel()))
        if layer == check_layer:
            # Every token was computed up to here: k/v already cover the whole request.
            layer_k, layer_v = k, v
            every_row = [torch.arange(span.length) for span in layout.spans]
            reused = _load_reused(adapter, layout, layer, every_row)
            state = CheckLayerState(layer, q, k, v, reused.keys, reused.values, adapter.attn_scale)
            selected = selector.select(SelectionContext(layout, state))
            active = _with_selected(always, selected)
            keep = active.to(device)[active_idx]
            q, hidden = q[keep], hidden[keep]
            active_idx = torch.nonzero(active).flatten().to(device)
            q_pos = positions[active_idx]
            plan = _reuse_plan(layout, active)
        else:
            reused = _load_reused(adapter, layout, layer, plan)
            layer_k, layer_v = _assemble(reused, k, v, active_idx, num_tokens)
        attn = attend(q, layer_k, layer_v, q_pos, positions, adapter.attn_scale, attention_backend)
        hidden = adapter.attention_output(layer, hidden, attn)
        if return_kv:
            keys.append(layer_k)
            values.append(layer_v)
    logits = adapter.logits(hidden[-1:])[0].float()
    return FusionResult(
        logits=logits,
        selected=selected,
        computed_tokens=tuple(computed),
        num_tokens=num_tokens,
        num_chunk_tokens=layout.num_chunk_tokens,
        kv=KVCache(tuple(keys), tuple(values)) if return_kv else None,
    )


@torch.inference_mode()
def decode_step(
    adapter: ModelAdapter, kv: KVCache, token_id: int, attention_backend: str = "torch"
) -> tuple[torch.Tensor, KVCache]:
    """One token at position kv.num_tokens over `kv`; returns float32 logits [vocab] and new KV."""
    device = adapter.device
    pos = torch.tensor([kv.num_tokens], device=device)
    key_positions = torch.arange(kv.num_tokens + 1, device=device)
    hidden = adapter.embed(torch.tensor([token_id], device=device))
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for layer in range(adapter.shape.num_layers):
        q, k, v = adapter.attention_inputs(layer, hidden)
        q, k = adapter.rotate(q, pos), adapter.rotate(k, pos)
        layer_k = torch.cat((kv.keys[layer], k.to(kv.keys[layer].dtype)))
        layer_v = torch.cat((kv.values[layer], v.to(kv.values[layer].dtype)))
        attn = attend(
            q, layer_k, layer_v, pos, key_positions, adapter.attn_scale, attention_backend
        )
        hidden = adapter.attention_output(layer, hidden, attn)
        keys.append(layer_k)
        values.append(layer_v)
    return adapter.logits(hidden)[0].float(), KVCache(tuple(keys), tuple(values))


def generate_greedy(
    adapter: ModelAdapter,
    segments: Sequence[Segment],
    selector: Selector,
    max_new_tokens: int,
    attention_backend: str = "torch",
) -> GenerationResult:
    """Fused prefill, then plain greedy decoding over the fused KV."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    prefill = fused_prefill(
        adapter, segments, selector, return_kv=True, attention_backend=attention_backend
    )
    assert prefill.kv is not None
    kv = prefill.kv
    token = int(prefill.logits.argmax())
    tokens = [token]
    for _ in range(max_new_tokens - 1):
        logits, kv = decode_step(adapter, kv, token, attention_backend)
        token = int(logits.argmax())
        tokens.append(token)
    return GenerationResult(tuple(tokens), prefill.logits, prefill)


def _check_request(adapter: ModelAdapter, layout: RequestLayout, selector: Selector) -> None:
    for span in layout.spans:
        span.chunk.check_compatible(adapter.shape)
    check = selector.check_layer
    if check is not None and check >= adapter.shape.num_layers:
        raise ValueError(f"{selector.name} checks layer {check}; model has too few layers")


def _with_selected(always: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    mask = always.clone()
    mask[selected.cpu()] = True
    return mask


class _Reused(NamedTuple):
    """Stored chunk KV of one layer for some tokens: keys rotated to their global positions."""

    positions: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor


def _reuse_plan(layout: RequestLayout, active: torch.Tensor) -> list[torch.Tensor]:
    """Per chunk occurrence, the local rows to load from the store (those not computed)."""
    return [
        torch.nonzero(~active[span.start : span.start + span.length]).flatten()
        for span in layout.spans
    ]


def _load_reused(
    adapter: ModelAdapter, layout: RequestLayout, layer: int, plan: list[torch.Tensor]
) -> _Reused:
    """Gather only the planned rows (a sparse load when chunks live in another tier)."""
    device, dtype = adapter.device, adapter.dtype
    keys, values, positions = [], [], []
    for span, rows in zip(layout.spans, plan, strict=True):
        if rows.numel() == 0:
            continue
        stored_k, stored_v = span.chunk.keys[layer], span.chunk.values[layer]
        keys.append(stored_k[rows.to(stored_k.device)].to(device=device, dtype=dtype))
        values.append(stored_v[rows.to(stored_v.device)].to(device=device, dtype=dtype))
        positions.append(rows.to(device) + span.start)
    if not keys:
        shape = (0, adapter.shape.num_kv_heads, adapter.shape.head_dim)
        empty = torch.empty(shape, device=device, dtype=dtype)
        return _Reused(torch.empty(0, dtype=torch.long, device=device), empty, empty)
    global_positions = torch.cat(positions)
    rotated = adapter.rotate(torch.cat(keys), global_positions)
    return _Reused(global_positions, rotated, torch.cat(values))


def _assemble(
    reused: _Reused, k: torch.Tensor, v: torch.Tensor, active_idx: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Request KV [N, Hkv, D]: reused rows and computed rows, each at its position."""
    if active_idx.numel() == num_tokens:
        # Every token computed this layer, in position order: nothing to scatter.
        return k, v
    layer_k = k.new_empty((num_tokens, *k.shape[1:]))
    layer_v = v.new_empty((num_tokens, *v.shape[1:]))
    layer_k[reused.positions] = reused.keys
    layer_v[reused.positions] = reused.values
    layer_k[active_idx] = k
    layer_v[active_idx] = v
    return layer_k, layer_v


__all__ = [
    "FusionResult",
    "GenerationResult",
    "KVCache",
    "decode_step",
    "fused_prefill",
    "generate_greedy",
    "precompute_chunk",
]
