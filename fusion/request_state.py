"""One request's state while the fused-prefill executor walks the layers.

Which tokens a request computes at each layer, where they sit, which stored chunk rows it loads
instead, and what it hands back. Positions below the exact prefix hold cached KV that is neither
computed nor queried; tokens outside chunks, the last token and every token from `outputs_from`
on are computed at every layer; chunk tokens up to and including the narrowing layer (the
selector's check layer or its last fresh layer, whichever is later), then only the selected ones.
A selector with scoring layers gets its scores from a scoring pass before the prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang_hicache_ext.fusion.adapter import ModelAdapter
from sglang_hicache_ext.fusion.fidelity_signals import chunk_rows_deviation, question_mass
from sglang_hicache_ext.fusion.layer_loader import LayerLoader
from sglang_hicache_ext.fusion.request import (
    RequestLayout,
    Segment,
    after_exact_prefix,
    build_layout,
)
from sglang_hicache_ext.fusion.selectors import (
    CheckLayerState,
    SelectionContext,
    Selector,
    question_logits,
)


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


# Elements of one block of question logits [heads, question rows, keys]: inline the keys are the
# whole prompt, and 96 rows of 32 heads over 128K keys would be 1.6 GB in fp32 at once.
QUESTION_LOGITS_BLOCK = 1 << 24


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
    # The question's attention to the chunk tokens, tempered as APE does (T, S): logits of
    # question -> chunk keys divided by T and that group's log-sum-exp multiplied by T * S.
    # (1, 1) is ordinary attention.
    context_temperature: float = 1.0
    context_scale: float = 1.0
    # Layers at which to record the question's attention to every chunk token (a scoring pass).
    record_layers: tuple[int, ...] = ()
    # Record what the prefill can tell about its own fidelity (`fusion.fidelity_signals`).
    record_signals: bool = False

    def __post_init__(self) -> None:
        if not self.context_temperature > 0 or not self.context_scale > 0:
            raise ValueError(
                "context temperature and scale must be > 0, got "
                f"{self.context_temperature} and {self.context_scale}"
            )

    @property
    def tempered(self) -> bool:
        return (self.context_temperature, self.context_scale) != (1.0, 1.0)


class RequestState:
    """A job's masks and bookkeeping across the layers (the executor does the compute)."""

    def __init__(
        self, adapter: ModelAdapter, job: FusionJob, loader: LayerLoader | None = None
    ) -> None:
        self.job = job
        self._combine_scores = adapter.combine_scores
        self.selector = job.selector
        self.prefix_len = 0 if job.exact_prefix is None else job.exact_prefix.num_tokens
        self.layout: RequestLayout = build_layout(after_exact_prefix(job.segments, self.prefix_len))
        self._check(adapter)
        num_tokens = self.layout.num_tokens
        self.device = adapter.device
        self.positions = torch.arange(num_tokens, device=self.device)
        # Index tensors the layers use again and again, on the device once: an index copied
        # from host memory waits for the GPU's queue to drain, at every layer and chunk.
        self._every_row = [torch.arange(span.length) for span in self.layout.spans]
        self._on_device: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._chunk_positions = self.layout.chunk_positions.to(self.device)
        always = ~self.layout.is_chunk
        always[: self.prefix_len] = False
        # The next-token logits come from the last token, so it is computed even inside a chunk.
        always[-1] = True
        if job.outputs_from is not None:
            always[job.outputs_from :] = True
        self.always = always
        num_layers = adapter.shape.num_layers
        # When the chunks' first tokens fill the budget the selection needs no scores, and no
        # scoring pass runs (unless the fidelity signals, which it records, are asked for). A
        # check layer still runs: the KV it computes for every token up to it is kept.
        scored = self.selector.scores_decide(self.layout) or job.record_signals
        # Where a scoring pass would cost more than computing the chunk tokens up to them, the
        # question's attention is measured inside the prefill: the last such layer checks.
        inline = self.selector.inline_scoring_layers(self.layout, num_layers)
        self.check_layer = max(inline) if inline else self.selector.check_layer
        self.scoring_layers = (
            self.selector.scoring_layers(num_layers) if scored and not inline else ()
        )
        self.record_layers = inline or job.record_layers
        self.inline = bool(inline)
        fresh = self.selector.fresh_layers
        checked = -1 if self.check_layer is None else self.check_layer
        # Where the computation narrows to the selection (None: it starts narrow at layer 0).
        narrow = max(checked, min(fresh, num_layers) - 1)
        self.narrow_layer = None if narrow < 0 else narrow
        # How many of the question's last tokens the scoring pass reads (None: all).
        self.scoring_question_tokens = self.selector.scoring_question_read(self.layout, num_layers)
        self.question_attention: torch.Tensor | None = None
        self.question_rows = 0  # softmax rows summed into question_attention (heads x queries)
        self.signals: dict[str, float] = {}
        self.selected = self.layout.chunk_positions[:0]
        self.computed: list[int] = []
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.window_scores: list[torch.Tensor] = []
        self.num_layers = adapter.shape.num_layers
        self.loader = LayerLoader(job.overlap_loads) if loader is None else loader
        self.narrowed = False
        # A scoring pass's assembled K/V per layer (`kv_out`), which the prefill takes (`kv_in`).
        self.kv_out: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.kv_in: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if self.check_layer is None and not self.scoring_layers:
            self.selected = self.selector.select(
                SelectionContext(self.layout, combine=adapter.combine_scores)
            )
        if self.narrow_layer is None:
            self._set_active(_with_selected(always, self.selected))
        else:
            # Every token after the exact prefix is computed up to the narrowing layer.
            everything = torch.ones(num_tokens, dtype=torch.bool)
            everything[: self.prefix_len] = False
            self._set_active(everything)

    def apply_scores(self, question_attention: torch.Tensor) -> None:
        """Select from a scoring pass's question attention [N_chunk] (before layer 0)."""
        ctx = SelectionContext(
            self.layout,
            question_attention=question_attention.cpu(),
            combine=self._combine_scores,
        )
        self.selected = self.selector.select(ctx)
        if self.narrow_layer is None:
            self._set_active(_with_selected(self.always, self.selected))

    def select_at_check_layer(self, check: CheckLayerState, queries: torch.Tensor) -> None:
        """Select from the check layer's activations (`queries`: this layer's active rows);
        measured inline, the question's attention at this layer counts too."""
        if check.layer in self.record_layers:
            self.record_question_attention(queries, check.keys, check.scale)
        ctx = SelectionContext(
            self.layout, check, self.question_attention, combine=self._combine_scores
        )
        self.selected = self.selector.select(ctx)
        if self.job.record_signals and self.question_attention is not None:
            total = float(self.question_rows)
            self.signals.update(question_mass(self.question_attention, self.layout.spans, total))

    def record_question_attention(
        self, queries: torch.Tensor, keys: torch.Tensor, scale: float
    ) -> None:
        """Add the softmax attention of this layer's question queries (post-RoPE, [Q, Hq, D]
        among the active rows) to each chunk token, summed over heads and question tokens.
        Computed a block of question rows at a time: inline, the keys are the whole prompt."""
        question = self.question_rows_active
        step = max(1, QUESTION_LOGITS_BLOCK // (queries.shape[1] * keys.shape[0]))
        for start in range(0, int(question.numel()), step):
            rows = question[start : start + step]
            logits = question_logits(queries[rows], self.q_pos[rows], keys, scale)
            self.question_rows += logits.shape[0] * logits.shape[1]
            # Summed on the device; `apply_scores` reads it back once, after the last layer.
            scores = logits.softmax(dim=-1).sum(dim=(0, 1))[self._chunk_positions]
            self.question_attention = (
                scores if self.question_attention is None else self.question_attention + scores
            )

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

    def plan_positions(self, plan: list[torch.Tensor]) -> torch.Tensor:
        """Global positions of a plan's rows, in load order; the same tensor at every layer
        for the request's plan (so RoPE's tables for it are computed once)."""
        if plan is self.plan and self._plan_positions is not None:
            return self._plan_positions
        positions = torch.cat(
            [rows + span.start for span, rows in zip(self.layout.spans, plan, strict=True)]
        ).to(self.device)
        if plan is self.plan:
            self._plan_positions = positions
        return positions

    def note_kv_deviation(self, layer: int, fresh_k: torch.Tensor, fresh_v: torch.Tensor) -> None:
        """Record how far this layer's pre-RoPE K/V of computed chunk tokens (rows of the
        active tokens) lie from their stored rows (`fidelity_signals`)."""
        positions = self.q_pos_host
        deviation = chunk_rows_deviation(self.layout.spans, positions, fresh_k, fresh_v, layer)
        if deviation is not None:
            self.signals[f"kv_deviation_l{layer}"] = deviation

    def every_row(self) -> list[torch.Tensor]:
        return self._every_row

    def on_device(self, plan: list[torch.Tensor]) -> list[torch.Tensor]:
        """`plan`'s row indices on the request's device, copied once per plan (the request's
        plan and `every_row` are the same lists at every layer)."""
        if self.device.type == "cpu":
            return plan
        cached = self._on_device.get(id(plan))
        if cached is None or cached[0] is not plan:
            moved = [rows.to(self.device, non_blocking=True) for rows in plan]
            cached = self._on_device[id(plan)] = (plan, moved)
        return cached[1]

    def load_plan(self, layer: int) -> list[torch.Tensor] | None:
        """Per chunk occurrence, the stored rows `layer` reads (None: not known yet). Up to the
        narrowing layer every token is computed (nothing to read) except at the check layer,
        where every row is read for the selector (none when it scores inline); after it, the
        rows not selected."""
        if layer in self.kv_in:
            return [rows[:0] for rows in self.plan]  # handed over by the scoring pass
        if self.narrow_layer is None:
            return self.plan
        if layer == self.check_layer:  # inline, the question's attention reads no stored row
            return self._nothing() if self.inline else self.every_row()
        if layer <= self.narrow_layer:
            return self._nothing()
        return self.plan if self.narrowed else None

    def _nothing(self) -> list[torch.Tensor]:
        return [rows[:0] for rows in self.every_row()]

    def prefetch(self, layer: int) -> None:
        """Start reading `layer`'s stored rows of slow-tier chunks, if the plan is known."""
        rows = self.load_plan(layer) if layer < self.num_layers else None
        for index, (span, span_rows) in enumerate(zip(self.layout.spans, rows or [], strict=False)):
            self.loader.submit(layer, index, span.chunk, span_rows)

    def narrow(self, selected: torch.Tensor) -> torch.Tensor:
        """At the narrowing layer: keep the selection; returns the indices of the current rows
        that stay."""
        self.selected = selected
        self.narrowed = True
        active = _with_selected(self.always, selected)
        # Which current rows stay, as indices found on the host: a boolean mask on the device
        # would be read back to count them.
        keep = torch.nonzero(active[self.q_pos_host]).flatten().to(self.device)
        self._set_active(active)
        return keep

    def outputs(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The last-layer rows of positions outputs_from..N-1 (the last active rows)."""
        start = self.job.outputs_from
        return None if start is None else hidden[start - self.num_tokens :]

    def _set_active(self, active: torch.Tensor) -> None:
        # The active rows' positions in host memory, and what attention and the scoring pass
        # need to know of them, found here so that no layer reads the device back: whether
        # they are the last positions in order (attention's causal case), and which active
        # rows are the question's.
        self.q_pos_host = torch.nonzero(active).flatten()
        self.active_idx = self.q_pos_host.to(self.device)
        self.q_pos = self.positions[self.active_idx]
        # Ascending and distinct: they are the last rows exactly when the first is N - n.
        count = self.q_pos_host.numel()
        self.causal = count > 0 and int(self.q_pos_host[0]) == self.layout.num_tokens - count
        question = torch.nonzero(self.layout.is_question[active]).flatten()
        cap = self.selector.scoring_question_tokens
        if self.inline and cap is not None:  # the question's last tokens (a pass reads its own)
            question = question[-cap:]
        self.question_rows_active = question.to(self.device)
        self._plan_positions: torch.Tensor | None = None
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
