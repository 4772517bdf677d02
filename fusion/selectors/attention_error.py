"""The error each reused token would put into the question's attention outputs."""

from __future__ import annotations

import torch

from sglang_hicache_ext.fusion.selectors.base import SelectionContext
from sglang_hicache_ext.fusion.selectors.check_layer_attention import A3Selector


class QuestionErrorSelector(A3Selector):
    """The error each reused token would put into the question's attention outputs at layer 1.

    For a question query q (head h) with attention a_i over the recomputed keys and output o,
    reusing token i instead of recomputing it changes the output, to first order, by
    a_i * (dv_i + (scale * q . dk_i) * (v_i - o)), where dk_i, dv_i are the stored minus the
    recomputed K/V. The score is that change's norm summed over question tokens and heads: A3's
    attention weighted by how wrong the stored KV actually is (CacheBlend's deviation), so neither
    a relevant token that reuse already gets right nor a deviating one nobody reads is recomputed.
    """

    name = "question_error"

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        state = ctx.require_state(self.name)
        attention = self.question_logits(ctx).softmax(dim=-1)  # [H, Q, N]
        question = torch.nonzero(ctx.layout.is_question).flatten().to(state.queries.device)
        chunk = ctx.layout.chunk_positions.to(state.keys.device)
        group = state.queries.shape[1] // state.keys.shape[1]
        keys = state.keys.float().repeat_interleave(group, dim=1)  # [N, H, D]
        values = state.values.float().repeat_interleave(group, dim=1)
        out = torch.einsum("hqk,khd->hqd", attention, values)  # [H, Q, D]
        a = attention[:, :, chunk]  # [H, Q, C]
        v = values[chunk]  # [C, H, D]
        dk = state.reused_keys.float().repeat_interleave(group, dim=1) - keys[chunk]
        dv = state.reused_values.float().repeat_interleave(group, dim=1) - v
        q = state.queries[question].float()
        b = a * torch.einsum("qhd,chd->hqc", q, dk) * state.scale
        # |a dv + b (v - o)|^2 expanded, so no [H, Q, C, D] tensor is built.
        dv2 = _sq_norm(dv)[:, None, :]
        dv_v = (dv * v).sum(-1).T[:, None, :]
        dv_o = torch.einsum("chd,hqd->hqc", dv, out)
        v_o = torch.einsum("chd,hqd->hqc", v, out)
        o2 = (out * out).sum(-1)[:, :, None]
        squared = (
            a * a * dv2
            + 2 * a * b * (dv_v - dv_o)
            + b * b * (_sq_norm(v)[:, None, :] - 2 * v_o + o2)
        )
        return squared.clamp(min=0).sqrt().sum(dim=(0, 1))


def _sq_norm(x: torch.Tensor) -> torch.Tensor:
    """[C, H, D] -> squared norms [H, C]."""
    return (x * x).sum(-1).T
