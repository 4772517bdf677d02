"""Plain decoding over a fused prefill's KV: one token at a time, every key visible.

What the evaluation harness and the in-process tests decode with (the server decodes with
SGLang's own forward over the KV the fused prefill wrote into its pool).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang_hicache_ext.fusion.adapter import ModelAdapter
from sglang_hicache_ext.fusion.attention import attend
from sglang_hicache_ext.fusion.executor import FusionResult, fused_prefill
from sglang_hicache_ext.fusion.request import Segment
from sglang_hicache_ext.fusion.request_state import KVCache
from sglang_hicache_ext.fusion.selectors import Selector


@dataclass(frozen=True, eq=False)
class GenerationResult:
    """Greedy continuation after a fused prefill; first_logits are the prefill's logits."""

    token_ids: tuple[int, ...]
    first_logits: torch.Tensor
    prefill: FusionResult


@torch.inference_mode()
def decode_step(
    adapter: ModelAdapter, kv: KVCache, token_id: int, attention_backend: str = "torch"
) -> tuple[torch.Tensor, KVCache]:
    """One token at position kv.position over `kv`; returns float32 logits [vocab] and new KV."""
    device = adapter.device
    pos = torch.tensor([kv.position], device=device)
    # The new token sees every key: after an eviction the kept rows carry no positions of
    # their own, so they are given 0.. (all below the query's).
    key_positions = torch.arange(kv.num_tokens + 1, device=device)
    hidden = adapter.embed(torch.tensor([token_id], device=device))
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for layer in range(adapter.shape.num_layers):
        q, k, v = adapter.attention_inputs(layer, hidden)
        q, k = adapter.rotate(q, pos, layer), adapter.rotate(k, pos, layer)
        layer_k = torch.cat((kv.keys[layer], k.to(kv.keys[layer].dtype)))
        layer_v = torch.cat((kv.values[layer], v.to(kv.values[layer].dtype)))
        kind = adapter.layers[layer]
        attn = attend(
            q,
            layer_k,
            layer_v,
            pos,
            key_positions,
            adapter.attn_scale,
            attention_backend,
            window=kind.sliding_window,
            logit_cap=kind.logit_cap,
        )
        hidden = adapter.attention_output(layer, hidden, attn)
        keys.append(layer_k)
        values.append(layer_v)
    following = None if kv.next_position is None else kv.next_position + 1
    return adapter.logits(hidden)[0].float(), KVCache(tuple(keys), tuple(values), following)


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
