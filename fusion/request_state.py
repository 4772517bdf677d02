"""One request's state while the fused-prefill executor walks the layers.

Which tokens a request computes at each layer, where they sit, which stored chunk rows it loads
instead, and what it hands back. Positions below the exact prefix hold cached KV that is neither
computed nor queried; tokens outside chunks, the last token and every token from `outputs_from`
on are computed at every layer; chunk tokens up to and including the selector's check layer,
then only the selected ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang_hicache_ext.fusion.adapter import ModelAdapter
from sglang_hicache_ext.fusion.layer_loader import LayerLoader
from sglang_hicache_ext.fusion.request import (
    RequestLayout,
    Segment,
    after_exact_prefix,
    build_layout,
)
from sglang_hicache_ext.fusion.selectors import SelectionContext, Selector


@dataclass(frozen=True, eq=False)
class KVCache:
    """Post-RoPE K and V of every layer for tokens at positions 0..num_tokens-1, or, after a
    decode-time eviction (`fusion.decode_eviction`), for the kept rows of a sequence whose next
    token goes at `next_position`."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    next_position: int | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.keys[0].shape[0])

    @property
    def position(self) -> int:
        """The position of the next token."""
        return self.num_tokens if self.next_position is None else self.next_position


@dataclass(frozen=True, eq=False)
class FusionJob:
    """One request of a fused prefill.

    segments: the whole prompt, positions 0..N-1. exact_prefix: the cached KV of positions
    0..P-1 (post-RoPE, every layer, e.g. a prefix-tree hit); those tokens are neither computed
    nor queried and a chunk they cover in part is reused only after them. outputs_from: every
    token from this position on is computed at every layer and its last-layer hidden state is
    returned (input logprobs need them); None: only the last token's logits. return_kv: the
    request KV of positions 0..N-1 for decoding.
    """

    segments: Sequence[Segment]
    selector: Selector
    exact_prefix: KVCache | None = None
    outputs_from: int | None = None
    return_kv: bool = False
    # Read the next layer's stored rows of slow-tier chunks while this layer computes
    # (`fusion.layer_loader`); False: read them when the layer needs them.
    overlap_loads: bool = True
    # > 0: score every token by the attention of the last `decode_window` prompt queries, for a
    # decode-time eviction (`fusion.decode_eviction`); 0: no scores.
    decode_window: int = 0


class RequestState:
    """A job's masks and bookkeeping across the layers (the executor does the compute)."""

    def __init__(self, adapter: ModelAdapter, job: FusionJob) -> None:
        self.job = job
        self.selector = job.selector
        self.prefix_len = 0 if job.exact_prefix is None else job.exact_prefix.num_tokens
        self.layout: RequestLayout = build_layout(after_exact_prefix(job.segments, self.prefix_len))
        self._check(adapter)
        num_tokens = self.layout.num_tokens
        self.device = adapter.device
        self.positions = torch.arange(num_tokens, device=self.device)
        always = ~self.layout.is_chunk
        always[: self.prefix_len] = False
        # The next-token logits come from the last token, so it is computed even inside a chunk.
        always[-1] = True
        if job.outputs_from is not None:
            always[job.outputs_from :] = True
        self.always = always
        self.check_layer = self.selector.check_layer
        self.selected = self.layout.chunk_positions[:0]
        self.computed: list[int] = []
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.window_scores: list[torch.Tensor] = []
        self.num_layers = adapter.shape.num_layers
        self.loader = LayerLoader(job.overlap_loads)
        self.narrowed = False
        if self.check_layer is None:
            self.selected = self.selector.select(SelectionContext(self.layout))
            self._set_active(_with_selected(always, self.selected))
        else:
            # Every token after the exact prefix is computed up to the check layer.
            everything = torch.ones(num_tokens, dtype=torch.bool)
            everything[: self.prefix_len] = False
            self._set_active(everything)

    @property
    def num_tokens(self) -> int:
        return self.layout.num_tokens

    @property
    def num_active(self) -> int:
        return int(self.active_idx.numel())

    def active_token_ids(self) -> torch.Tensor:
        return self.layout.token_ids.to(self.device)[self.active_idx]

    def prefix_kv(
        self, layer: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        prefix = self.job.exact_prefix
        if prefix is None:
            return None, None
        return (
            prefix.keys[layer].to(device=self.device, dtype=dtype),
            prefix.values[layer].to(device=self.device, dtype=dtype),
        )

    def every_row(self) -> list[torch.Tensor]:
        return [torch.arange(span.length) for span in self.layout.spans]

    def load_plan(self, layer: int) -> list[torch.Tensor] | None:
        """Per chunk occurrence, the stored rows `layer` reads (None: not known yet). Before
        the check layer every token is computed (nothing to read), at it every row is read,
        after it the rows not selected."""
        check = self.check_layer
        if check is None or layer < check:
            return self.plan
        if layer == check:
            return self.every_row()
        return self.plan if self.narrowed else None

    def prefetch(self, layer: int) -> None:
        """Start reading `layer`'s stored rows of slow-tier chunks, if the plan is known."""
        rows = self.load_plan(layer) if layer < self.num_layers else None
        for index, (span, span_rows) in enumerate(zip(self.layout.spans, rows or [], strict=False)):
            self.loader.submit(layer, index, span.chunk, span_rows)

    def narrow(self, selected: torch.Tensor) -> torch.Tensor:
        """After the check layer: keep the selection; returns which current rows stay."""
        self.selected = selected
        self.narrowed = True
        active = _with_selected(self.always, selected)
        keep = active.to(self.device)[self.active_idx]
        self._set_active(active)
        return keep

    def outputs(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The last-layer rows of positions outputs_from..N-1 (the last active rows)."""
        start = self.job.outputs_from
        return None if start is None else hidden[start - self.num_tokens :]

    def _set_active(self, active: torch.Tensor) -> None:
        self.active_idx = torch.nonzero(active).flatten().to(self.device)
        self.q_pos = self.positions[self.active_idx]
        # Per chunk occurrence, the local rows to load from the store (those not computed).
        self.plan = [
            torch.nonzero(~active[span.start : span.start + span.length]).flatten()
            for span in self.layout.spans
        ]

    def _check(self, adapter: ModelAdapter) -> None:
        shape = adapter.shape
        for span in self.layout.spans:
            span.chunk.check_compatible(shape)
        check = self.selector.check_layer
        if check is not None and check >= shape.num_layers:
            raise ValueError(f"{self.selector.name} checks layer {check}; model has too few layers")
        num_tokens = self.layout.num_tokens
        prefix = self.job.exact_prefix
        if prefix is not None:
            if len(prefix.keys) != shape.num_layers or len(prefix.values) != shape.num_layers:
                raise ValueError("the exact prefix must hold K and V of every layer")
            if self.prefix_len >= num_tokens:
                raise ValueError(
                    f"an exact prefix of {self.prefix_len} tokens leaves nothing to compute "
                    f"in a {num_tokens}-token request"
                )
        start = self.job.outputs_from
        if start is not None and not self.prefix_len <= start < num_tokens:
            raise ValueError(
                f"outputs_from={start} must lie in [{self.prefix_len}, {num_tokens}): "
                "cached prefix tokens are not computed"
            )


def _with_selected(always: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    mask = always.clone()
    mask[selected.cpu()] = True
    return mask
