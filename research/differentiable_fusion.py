"""The fused prefill with a fixed selection, differentiable: what research/chunk_trailer.py trains
through. The executor (`fusion/executor.py`) runs under `torch.inference_mode` and chooses its
selection inside; here the selection is given (the executor's own, replayed), every text token
and selected chunk token is computed at every layer over the stored rows of the others at their
global positions, and gradients flow into the stored rows (a trailer's). Checked against the
executor's logits and a finite difference by `chunk_trailer.main`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from sglang_hicache_ext.fusion.adapter import ModelAdapter
from sglang_hicache_ext.fusion.chunk import PrecomputedChunk
from sglang_hicache_ext.fusion.request import Segment, TextSegment


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qpos: torch.Tensor,
    kpos: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Differentiable attention by position: q [n, Hq, D] over k/v [N, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    mask = kpos.unsqueeze(0) <= qpos.unsqueeze(1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


def fused_forward(
    adapter: ModelAdapter, segments: Sequence[Segment], selected: torch.Tensor | None = None
) -> torch.Tensor:
    """Logits [computed tokens, vocab] of the fused prefill with a fixed selection: every text
    token and the chunk tokens at the global positions `selected` computed at every layer, every
    other chunk row reused (keys rotated to its global position); r = 0 when nothing is selected.
    The rows are in position order, so the last ones are the text after the last chunk."""
    ids_at: list[int] = []
    is_text: list[bool] = []
    stored: list[PrecomputedChunk | int] = []  # each segment's chunk, or its text length
    for segment in segments:
        if isinstance(segment, TextSegment):
            ids_at.extend(segment.token_ids)
            is_text.extend([True] * len(segment.token_ids))
            stored.append(len(segment.token_ids))
        else:
            ids_at.extend(segment.chunk.token_ids)
            is_text.extend([False] * segment.chunk.num_tokens)
            stored.append(segment.chunk)
    total = len(ids_at)
    computed = torch.tensor(is_text)
    if selected is not None and selected.numel():
        computed[selected] = True
    comp_pos = torch.nonzero(computed).flatten()
    everything = torch.arange(total)
    hidden = adapter.embed(torch.tensor(ids_at)[comp_pos])
    for layer in range(adapter.shape.num_layers):
        q, k, v = adapter.attention_inputs(layer, hidden)
        # The stored rows at every chunk position (zeros at text), the computed rows over them.
        base_k = torch.cat(
            [
                k.new_zeros((p, *k.shape[1:])) if isinstance(p, int) else p.keys[layer].to(k.dtype)
                for p in stored
            ]
        )
        base_v = torch.cat(
            [
                v.new_zeros((p, *v.shape[1:]))
                if isinstance(p, int)
                else p.values[layer].to(v.dtype)
                for p in stored
            ]
        )
        all_k = base_k.index_put((comp_pos,), k)
        all_v = base_v.index_put((comp_pos,), v)
        attn = attention(
            adapter.rotate(q, comp_pos, layer),
            adapter.rotate(all_k, everything, layer),
            all_v,
            comp_pos,
            everything,
            adapter.attn_scale,
        )
        hidden = adapter.attention_output(layer, hidden, attn)
    return adapter.logits(hidden)
