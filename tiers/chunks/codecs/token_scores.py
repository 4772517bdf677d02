"""How much each token of a chunk layer matters, for the codecs that drop tokens: one `score()`
per strategy (kvpress's contract), higher = keep. Scores are per token across heads (the mean
over KV heads): a dropped token is dropped from every head of the layer, so the layer stays one
dense block of rows."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F


class TokenScorer(ABC):
    needs_queries = False

    @abstractmethod
    def score(
        self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None
    ) -> torch.Tensor:
        """Scores [tokens] of K/V [tokens, kv_heads, dim]."""


class KeyNormScorer(TokenScorer):
    """Keys with a small norm draw the most attention (Devoto et al. 2024; kvpress KnormPress)."""

    def score(
        self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None
    ) -> torch.Tensor:
        return -keys.float().norm(dim=-1).mean(dim=-1)


class KeyDiffScorer(TokenScorer):
    """Keys least similar to the layer's mean key direction are kept (KeyDiff, Park et al. 2025;
    kvpress KeyDiffPress)."""

    def score(
        self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None
    ) -> torch.Tensor:
        unit = F.normalize(keys.float(), dim=-1)
        anchor = unit.mean(dim=0, keepdim=True)
        return -F.cosine_similarity(unit, anchor, dim=-1).mean(dim=-1)


class ProbeAttentionScorer(TokenScorer):
    """SnapKV's score with probe queries as the observation window: the attention the probes
    give each token, averaged over probes and heads, smoothed by a 1-D pooling so that
    neighbours of an attended token are kept with it (Li et al. 2024)."""

    needs_queries = True

    def __init__(self, kernel: int = 5) -> None:
        self.kernel = kernel

    def score(
        self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None
    ) -> torch.Tensor:
        if queries is None or queries.numel() == 0:
            raise ValueError("snapkv scores need probe queries")
        kv_heads, q_heads = keys.shape[1], queries.shape[1]
        if q_heads % kv_heads:
            raise ValueError(f"{q_heads} query heads do not group over {kv_heads} KV heads")
        # [q_heads, probes, dim] x [q_heads, dim, tokens]: each query head reads its KV head.
        k = keys.float().repeat_interleave(q_heads // kv_heads, dim=1).permute(1, 2, 0)
        q = queries.float().permute(1, 0, 2)
        attention = torch.softmax(q @ k / math.sqrt(keys.shape[-1]), dim=-1)
        per_token = attention.mean(dim=(0, 1))
        pooled = F.avg_pool1d(
            per_token[None, None], self.kernel, stride=1, padding=self.kernel // 2
        )
        return pooled[0, 0, : keys.shape[0]]


SCORERS: dict[str, type[TokenScorer]] = {
    "knorm": KeyNormScorer,
    "keydiff": KeyDiffScorer,
    "snapkv": ProbeAttentionScorer,
}
