"""A fused request's computed rows, handed out round by round.

A fused request is computed whole in its first chunked-prefill round (the selector must see the
whole prompt), but SGLang allocates KV slots one round at a time. `FusedRows` holds what the
executor produced for the positions not written yet: K/V per layer and, for positions whose
logits the response needs, the final-normed hidden states. Each round takes its rows; the rest
waits in host memory until the next round, and is dropped with the request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, eq=False)
class RoundRows:
    """The rows of one round: K/V [extend, Hkv, D] per layer, and hidden states of its positions
    from `hidden_offset` on (None when the round needs none of them)."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    hidden: torch.Tensor | None
    hidden_offset: int


@dataclass(eq=False)
class FusedRows:
    """Rows of prompt positions `start`..`end`-1 not yet written to SGLang's KV pool."""

    start: int
    end: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    # Final-normed last-layer hidden states of positions hidden_start..end-1.
    hidden: torch.Tensor | None
    hidden_start: int
    info: dict[str, Any]
    rounds: int = 0
    on_host: bool = False

    @property
    def done(self) -> bool:
        return self.start >= self.end

    @property
    def nbytes(self) -> int:
        tensors = [*self.keys, *self.values, *([self.hidden] if self.hidden is not None else [])]
        return sum(t.numel() * t.element_size() for t in tensors)

    def take(self, prefix_len: int, extend_len: int) -> RoundRows:
        """The rows of a round covering positions prefix_len..prefix_len+extend_len-1."""
        if prefix_len != self.start or prefix_len + extend_len > self.end:
            raise RuntimeError(
                f"fused rows cover positions {self.start}..{self.end - 1}; the round asks for "
                f"{prefix_len}..{prefix_len + extend_len - 1}"
            )
        stop = prefix_len + extend_len
        count = extend_len
        keys = tuple(k[:count] for k in self.keys)
        values = tuple(v[:count] for v in self.values)
        hidden, offset = None, 0
        if self.hidden is not None and stop > self.hidden_start:
            first = max(prefix_len, self.hidden_start)
            hidden = self.hidden[first - self.hidden_start : stop - self.hidden_start]
            offset = first - prefix_len
        self.keys = [k[count:] for k in self.keys]
        self.values = [v[count:] for v in self.values]
        if self.hidden is not None and stop > self.hidden_start:
            self.hidden = self.hidden[stop - self.hidden_start :]
            self.hidden_start = stop
        self.start = stop
        self.rounds += 1
        return RoundRows(keys, values, hidden, offset)

    def keep_on_host(self) -> None:
        """Copy what later rounds need to host memory, dropping the device tensors (and the
        whole-prompt tensors the remaining rows were views of)."""
        if self.on_host:
            return
        self.keys = [k.to("cpu", copy=True) for k in self.keys]
        self.values = [v.to("cpu", copy=True) for v in self.values]
        if self.hidden is not None:
            self.hidden = self.hidden.to("cpu", copy=True)
        self.on_host = True
