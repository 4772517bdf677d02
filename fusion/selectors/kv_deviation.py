"""How far the stored KV is from the recomputed KV at the check layer (CacheBlend)."""

from __future__ import annotations

import torch

from sglang_hicache_ext.fusion.selectors.base import SelectionContext, Selector


class CacheBlendSelector(Selector):
    """CacheBlend: largest K/V deviation between recomputed and reused KV at layer 1."""

    name = "cacheblend"
    check_layer = 1

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        state = ctx.require_state(self.name)
        chunk = ctx.layout.chunk_positions.to(state.keys.device)
        dk = (state.keys[chunk].float() - state.reused_keys.float()).flatten(1).norm(dim=-1)
        dv = (state.values[chunk].float() - state.reused_values.float()).flatten(1).norm(dim=-1)
        return dk + dv
