"""Offline low-frequency energy (CacheTune): scores stored with each chunk, no runtime pass."""

from __future__ import annotations

import torch

from sglang_hicache_ext.fusion.selectors.base import SelectionContext, Selector


class FrequencySelector(Selector):
    """CacheTune: offline low-frequency energy scores stored with each chunk.

    One index set serves every layer (a token recomputed at layer l needs its layer l-1 state),
    so per-layer scores are averaged, or one `layer`'s scores are used.
    """

    name = "freq"
    per_chunk = True

    def __init__(
        self, ratio: float, layer: int | None = None, sink_tokens: int = 0, fresh_layers: int = 0
    ) -> None:
        super().__init__(ratio, sink_tokens, fresh_layers)
        self.layer = layer

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        parts = []
        for span in ctx.layout.spans:
            scores = span.chunk.freq_scores.float().cpu()
            parts.append(scores.mean(0) if self.layer is None else scores[self.layer])
        return torch.cat(parts)
