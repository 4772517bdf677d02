"""Each chunk's first tokens (EPIC): the attention sinks a chunk prefilled alone makes."""

from __future__ import annotations

import torch

from sglang_hicache_ext.fusion.selectors.base import SelectionContext, Selector


class EpicSelector(Selector):
    """EPIC: the first tokens of each chunk (attention sinks at chunk starts)."""

    name = "epic"
    per_chunk = True

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        local = [torch.arange(span.length, dtype=torch.float32) for span in ctx.layout.spans]
        return -torch.cat(local)
