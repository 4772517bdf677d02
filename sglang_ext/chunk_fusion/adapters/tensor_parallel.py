"""The scheduler's tensor-parallel group as fused prefills use it (`--tp-size`).

With `--tp-size N` every scheduler process (rank) holds its shard of each layer's heads, of
the MLP's and experts' columns and of the LM head's vocabulary; SGLang's forward joins the
shards with collectives inside its modules or at its stage boundaries. The adapters call the
modules one by one, so they add the collectives SGLang's boundaries would: a sum of the
partial outputs of a row-parallel module that does not reduce its own, the vocabulary shards
of the logits gathered, and the selectors' scores summed so every rank recomputes the same
tokens. `agree` is the guard around all of it: every rank must take the same branch (fuse or
not, which chunks, which rows) or the next collective waits forever.

Every method is a collective at N > 1: each rank calls it at the same point, in the same order.
At N = 1 each is the identity and costs nothing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorParallel:
    """One scheduler's rank in its tensor-parallel group; `group` is SGLang's coordinator."""

    rank: int = 0
    size: int = 1
    group: Any = None

    @classmethod
    def of_scheduler(cls) -> TensorParallel:
        """The group SGLang initialised in this process (a group of one before that)."""
        from sglang.srt.distributed import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            return cls()
        group = parallel_state.get_tp_group()
        return cls(int(group.rank_in_group), int(group.world_size), group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, on SGLang's device group: `x` must be on the model's
        device (NCCL takes no host tensors)."""
        return x if self.size == 1 else self.group.all_reduce(x.contiguous())

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` [n, c] side by side, in rank order: [n, c * size]."""
        return x if self.size == 1 else self.group.all_gather(x.contiguous(), dim=-1)

    def agree(self, decision: str) -> bool:
        """Whether every rank reached the same `decision` (a digest of what it will do)."""
        if self.size == 1:
            return True
        digest = hashlib.blake2b(decision.encode(), digest_size=8).digest()
        mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(self.size)]
        torch.distributed.all_gather(every, mine, group=self.group.cpu_group)
        return all(bool(torch.equal(other, mine)) for other in every)

    def slowest(self, seconds: float) -> float:
        """The longest of every rank's `seconds` (a batch takes as long as its slowest rank):
        what each rank's "auto" learns, so their ratios stay equal."""
        if self.size == 1:
            return seconds
        value = torch.tensor([seconds], dtype=torch.float64)
        torch.distributed.all_reduce(
            value, op=torch.distributed.ReduceOp.MAX, group=self.group.cpu_group
        )
        return float(value)

    def reduces(self, module: object) -> bool:
        """Whether `module`'s output is already the sum over ranks: SGLang's `reduce_results`
        of a `RowParallelLinear` or `FusedMoE` (a module without it is not sharded by rows)."""
        return self.size == 1 or bool(getattr(module, "reduce_results", True))

    def scoped(self, name: str) -> str:
        """`name` of what this rank stores (its shard): `<name>-tp<rank>of<size>`, and `name`
        itself at one rank, so nothing stored before tensor parallelism moves."""
        return name if self.size == 1 else f"{name}-tp{self.rank}of{self.size}"
