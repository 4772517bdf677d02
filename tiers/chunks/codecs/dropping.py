"""Token dropping: keep the (1 - ratio) highest-scored tokens of each layer, leave out the rest.

The kept rows keep their token indices (`kept`), so positions are recovered as for dense rows;
the dropped tokens are absent from that layer's attention."""

from __future__ import annotations

import math

import torch

from sglang_hicache_ext.tiers.chunks.codecs.base import CompressedLayer, DecodedLayer, KVCodec
from sglang_hicache_ext.tiers.chunks.codecs.token_scores import SCORERS, TokenScorer


class TokenDroppingCodec(KVCodec):
    def __init__(self, name: str, ratio: float) -> None:
        if name not in SCORERS:
            raise ValueError(f"unknown token scorer {name!r}; choose from {sorted(SCORERS)}")
        if not 0 < ratio < 1:
            raise ValueError(f"drop ratio of {name} must be in (0, 1), got {ratio}")
        self.name = name
        self.ratio = ratio
        self.scorer: TokenScorer = SCORERS[name]()

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.ratio:g}"

    def keep_count(self, num_tokens: int) -> int:
        return max(1, num_tokens - math.floor(self.ratio * num_tokens))

    def encode(
        self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None = None
    ) -> CompressedLayer:
        n = keys.shape[0]
        scores = self.scorer.score(keys, values, queries)
        kept = scores.topk(self.keep_count(n)).indices.sort().values
        return CompressedLayer(
            self.spec,
            n,
            keys.dtype,
            {"keys": keys[kept].clone(), "values": values[kept].clone(), "kept": kept.int()},
        )

    def decode(self, layer: CompressedLayer) -> DecodedLayer:
        t = layer.tensors
        return DecodedLayer(t["keys"], t["values"], t["kept"].long())
