"""Uniformly random chunk tokens: the baseline every scoring selector must beat."""

from __future__ import annotations

import torch

from sglang_hicache_ext.fusion.selectors.base import SelectionContext, Selector


class RandomSelector(Selector):
    """Uniformly random tokens (seeded, so runs are reproducible)."""

    name = "random"

    def __init__(
        self, ratio: float, seed: int = 0, sink_tokens: int = 0, fresh_layers: int = 0
    ) -> None:
        super().__init__(ratio, sink_tokens, fresh_layers)
        self.seed = seed

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed)
        return torch.rand(ctx.layout.num_chunk_tokens, generator=generator)
