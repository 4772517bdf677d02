"""What the tensor-parallel ranks of one server must agree on before and after a fused prefill.

Under `--tp-size N` every rank plans each batch from its own state: its shard of the chunk
tiers, its own clock for "auto"'s measurements, its own disk faults. A rank that fuses while
another computes normally would wait forever on the other's collectives, and ranks that
recompute different tokens would sum attention outputs of different rows. So each batch's plans
are compared first (one 8-byte digest per rank): on any difference every rank computes the batch
normally (`fallback: "tp_ranks_disagree"`, counted and logged). After the fused prefill the
recomputed positions are compared the same way, before any KV is written. At one rank both
checks cost nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.tensor_parallel import TensorParallel
from sglang_hicache_ext.sglang_ext.chunk_fusion.plan import RequestPlan

logger = logging.getLogger(__name__)

RANKS_DISAGREE = "tp_ranks_disagree"  # the fallback reason


class RanksDisagreeError(RuntimeError):
    """The ranks recomputed different chunk tokens; nothing of the batch was written."""


def plans_agree(tp: TensorParallel, plans: Sequence[RequestPlan]) -> bool:
    """Whether every rank planned this batch alike (a collective at N > 1)."""
    if tp.size == 1:
        return True
    agreed = tp.agree(";".join(_plan_digest(plan) for plan in plans))
    if not agreed:
        logger.error(
            "fusion: tensor-parallel rank %d planned batch %s unlike another rank; every rank "
            "computes it normally (%s)",
            tp.rank,
            [plan.rid for plan in plans],
            RANKS_DISAGREE,
        )
    return agreed


def check_selections(tp: TensorParallel, selected: Sequence[torch.Tensor]) -> None:
    """Raise RanksDisagreeError unless every rank recomputed the same positions per request."""
    if tp.size == 1:
        return
    mine = ";".join(",".join(map(str, positions.tolist())) for positions in selected)
    if not tp.agree(mine):
        raise RanksDisagreeError(
            f"tensor-parallel rank {tp.rank} recomputed other chunk tokens than another rank"
        )


def _plan_digest(plan: RequestPlan) -> str:
    # Everything that decides which collectives a rank issues and what it recomputes.
    if not plan.fused:
        return f"{plan.rid}:{plan.prefix_len}+{plan.extend_len}:normal"
    if plan.continuation is not None:
        return f"{plan.rid}:{plan.prefix_len}+{plan.extend_len}:rows"
    assert plan.options is not None
    return (
        f"{plan.rid}:{plan.prefix_len}+{plan.extend_len}:{plan.pinned}:"
        f"{sorted(plan.tokens_by_tier.items())}:{plan.options.selector}:"
        f"{plan.recompute_ratio!r}:{plan.probe_form}"
    )
