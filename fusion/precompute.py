"""How a chunk's stored KV is computed: alone, or after the prefix it is served behind.

A chunk's keys are stored before RoPE, so the chunk can be placed at any position; what its
rows cannot forget is the context they were computed in. Prefilled alone at 0..n-1, the chunk's
first token is the sequence's first token and becomes an attention sink (models without a BOS
token, such as Qwen2.5, have nothing else to sink into); prefilled after the deployment's
system prompt and chat header, its rows look like those of the prompts it will be served in
(CacheBlend's reference code, APE and CacheClip precompute contexts after a shared prefix).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sglang_hicache_ext.fusion.adapter import ModelAdapter
from sglang_hicache_ext.fusion.attention import attend
from sglang_hicache_ext.fusion.chunk import PrecomputedChunk
from sglang_hicache_ext.fusion.frequency import DEFAULT_ALPHA, frequency_scores


@torch.inference_mode()
def precompute_chunk(
    adapter: ModelAdapter,
    token_ids: Sequence[int],
    alpha: float = DEFAULT_ALPHA,
    prefix_ids: Sequence[int] = (),
) -> PrecomputedChunk:
    """Prefill a chunk and keep its pre-RoPE K, V and frequency scores.

    Without `prefix_ids` the chunk is prefilled alone at positions 0..n-1, so its first token
    becomes an attention sink of its own (models without a BOS token, such as Qwen2.5). With
    them, the chunk is prefilled after that prefix (the deployment's system prompt and chat
    header, as it is served) and only the chunk's rows are kept: its first tokens then carry
    the activations they have in a real prompt. Keys are stored before RoPE, so where the chunk
    sat while it was computed does not matter to its reuse.
    """
    ids = tuple(int(t) for t in token_ids)
    if not ids:
        raise ValueError("cannot precompute an empty chunk")
    prefix = tuple(int(t) for t in prefix_ids)
    device = adapter.device
    positions = torch.arange(len(prefix) + len(ids), device=device)
    hidden = adapter.embed(torch.tensor(prefix + ids, device=device))
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for layer in range(adapter.shape.num_layers):
        q, k, v = adapter.attention_inputs(layer, hidden)
        keys.append(k[len(prefix) :].contiguous())
        values.append(v[len(prefix) :].contiguous())
        q, k = adapter.rotate(q, positions, layer), adapter.rotate(k, positions, layer)
        kind = adapter.layers[layer]
        attn = attend(
            q,
            k,
            v,
            positions,
            positions,
            adapter.attn_scale,
            window=kind.sliding_window,
            logit_cap=kind.logit_cap,
        )
        hidden = adapter.attention_output(layer, hidden, attn)
    scores = torch.stack([frequency_scores(k, v, alpha) for k, v in zip(keys, values, strict=True)])
    return PrecomputedChunk(
        token_ids=ids, keys=tuple(keys), values=tuple(values), freq_scores=scores, alpha=alpha
    )
