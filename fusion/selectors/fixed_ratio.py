"""The two selectors whose ratio is fixed: the normal prefill and pure reuse."""

from __future__ import annotations

from typing import ClassVar

import torch

from sglang_hicache_ext.fusion.selectors.base import SelectionContext, Selector


class FixedRatioSelector(Selector):
    """A selector whose ratio is fixed: a given one is only validated, every token scores it."""

    fixed_ratio: ClassVar[float]

    def __init__(
        self, ratio: float | None = None, sink_tokens: int = 0, fresh_layers: int = 0
    ) -> None:
        super().__init__(self.fixed_ratio if ratio is None else ratio, sink_tokens, fresh_layers)
        self.ratio = self.fixed_ratio

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        return torch.full((ctx.layout.num_chunk_tokens,), self.fixed_ratio)


class FullSelector(FixedRatioSelector):
    """Normal prefill: every chunk token is recomputed (ratio is forced to 1)."""

    name = "full"
    fixed_ratio = 1.0


class ReuseSelector(FixedRatioSelector):
    """Pure reuse: nothing recomputed (ratio is forced to 0)."""

    name = "reuse"
    fixed_ratio = 0.0
