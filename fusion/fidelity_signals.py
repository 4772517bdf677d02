"""What a fused prefill can tell about its own fidelity from what it computes anyway.

A fixed recompute ratio spends the same on every request; a request that needs more could be
told apart by signals read inside its own prefill (issue 41). Recorded only when a job asks
(`FusionJob.record_signals`: the retention harness), they are:
- `kv_deviation_l1`, `kv_deviation_l2`: how far the K/V freshly computed for chunk tokens at
  layers 1 and 2 lie from the stored rows of the same tokens (relative L2 over K and V; layer 0
  is left out: its input is the token's own embedding, the same in and out of context). The
  chunk tokens computed there are the selection, or every chunk token up to a check layer.
- `question_chunk_share`, `question_chunk_entropy`, `question_top_chunk_share`: from the scoring
  pass, the share of the question's attention that lands on chunk tokens, how evenly it spreads
  over the chunks (entropy / log of the number of chunks: 1 when a question reads every chunk
  alike, as a multi-hop question must), and the share of the most-read chunk.
- `first_token_margin`, `first_token_entropy`: the next-token logits' top-1 minus top-2 gap and
  their softmax entropy (nats): a greedy answer whose first token is a near tie flips easily.
- `chunks`, `chunk_tokens`, `question_tokens`, `prompt_tokens`: the prompt's shape.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from sglang_hicache_ext.fusion.request import ChunkSpan, RequestLayout

SIGNAL_LAYERS = (1, 2)


def chunk_rows_deviation(
    spans: Sequence[ChunkSpan],
    positions: torch.Tensor,
    fresh_k: torch.Tensor,
    fresh_v: torch.Tensor,
    layer: int,
) -> float | None:
    """How far the pre-RoPE K and V computed at `layer` for the chunk tokens among the global
    `positions` (sorted, host memory; rows of `fresh_k`/`fresh_v`) lie from the stored rows of
    the same tokens: relative L2 over K and V. None when no chunk token was computed."""
    squared_diff = squared_ref = 0.0
    for span in spans:
        inside = torch.nonzero(
            (positions >= span.start) & (positions < span.start + span.length)
        ).flatten()
        if inside.numel() == 0:
            continue
        stored_k, stored_v = span.chunk.rows(layer, positions[inside] - span.start)
        where = inside.to(fresh_k.device)
        for fresh, stored in ((fresh_k[where], stored_k), (fresh_v[where], stored_v)):
            stored = stored.to(fresh.device).float()
            squared_diff += float((fresh.float() - stored).square().sum())
            squared_ref += float(stored.square().sum())
    if squared_ref == 0.0:
        return None
    return math.sqrt(squared_diff / squared_ref)


def question_mass(
    question_attention: torch.Tensor, spans: Sequence[ChunkSpan], total: float
) -> dict[str, float]:
    """Signals of the scoring pass's summed attention to each chunk token [N_chunk] (chunk
    order), `total` being the attention of every question row it summed (one per head, query
    and layer)."""
    per_chunk = torch.stack(
        [part.sum() for part in question_attention.float().split([s.length for s in spans])]
    )
    mass = float(per_chunk.sum())
    signals = {"question_chunk_share": mass / total if total else 0.0}
    if mass > 0:
        p = per_chunk / mass
        entropy = float(-(p * p.clamp_min(1e-30).log()).sum())
        signals["question_chunk_entropy"] = entropy / math.log(len(spans)) if len(spans) > 1 else 0
        signals["question_top_chunk_share"] = float(p.max())
    return signals


def first_token_signals(logits: torch.Tensor) -> dict[str, float]:
    """Top-1 minus top-2 logit and the softmax entropy (nats) of next-token logits [vocab]."""
    top = torch.topk(logits.float(), 2).values
    log_p = torch.log_softmax(logits.float(), dim=-1)
    return {
        "first_token_margin": float(top[0] - top[1]),
        "first_token_entropy": float(-(log_p.exp() * log_p).sum()),
    }


def prompt_shape(layout: RequestLayout) -> dict[str, float]:
    return {
        "chunks": float(len(layout.spans)),
        "chunk_tokens": float(layout.num_chunk_tokens),
        "question_tokens": float(layout.is_question.sum()),
        "prompt_tokens": float(layout.num_tokens),
    }


__all__ = [
    "SIGNAL_LAYERS",
    "chunk_rows_deviation",
    "first_token_signals",
    "prompt_shape",
    "question_mass",
]
