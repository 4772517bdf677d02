"""The question's attention at one check layer (A3), and the masked q.k it is built from."""

from __future__ import annotations

import torch

from sglang_hicache_ext.fusion.selectors.base import SelectionContext, Selector


class A3Selector(Selector):
    """A3: softmax attention of question tokens over chunk tokens at layer 1, summed."""

    name = "a3"
    check_layer = 1

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        per_token = self.question_logits(ctx).softmax(dim=-1).sum(dim=(0, 1))
        return per_token[ctx.layout.chunk_positions.to(per_token.device)]

    def question_logits(self, ctx: SelectionContext) -> torch.Tensor:
        """Scaled q.k [heads, question tokens, keys] at the check layer; -inf for later keys."""
        state = ctx.require_state(self.name)
        question = torch.nonzero(ctx.layout.is_question).flatten().to(state.queries.device)
        if question.numel() == 0:
            raise ValueError("a3 needs question tokens (a TextSegment after the chunks)")
        return question_logits(state.queries[question], question, state.keys, state.scale)


def question_logits(
    queries: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, scale: float
) -> torch.Tensor:
    """Scaled q.k [heads, queries, keys] of post-RoPE `queries` [Q, Hq, D] at global `positions`
    over `keys` [N, Hkv, D] at 0..N-1; -inf where a key lies after its query."""
    num_queries, num_heads, dim = queries.shape
    group = num_heads // keys.shape[1]
    # Query head h*group + j reads key head h: grouped, not the keys repeated per query head
    # (an fp32 copy of every key, group times over, at each scoring layer).
    q = queries.float().reshape(num_queries, keys.shape[1], group, dim)
    logits = torch.einsum("qhjd,khd->hjqk", q, keys.float()).reshape(num_heads, num_queries, -1)
    logits = logits * scale
    key_pos = torch.arange(keys.shape[0], device=keys.device)
    visible = key_pos[None, None, :] <= positions.to(keys.device)[None, :, None]
    return logits.masked_fill(~visible, float("-inf"))
