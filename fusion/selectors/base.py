"""The contract every selector keeps: score the chunk tokens of a request, select a budget.

Every selector scores the chunk tokens of a request (higher = recompute first) and `select()`
turns scores into a fixed budget of round(ratio x chunk tokens) global positions. Selectors with
a `check_layer` score from that layer's activations (the executor computes every token up to
it); selectors with `scoring_layers` score from the question's attention in a scoring pass run
before the prefill (the question over the reused KV, `fusion/executor.py`); a selector may
instead measure that attention inside the prefill (`inline_scoring_layers`: every token computed
up to them, the last the check layer) where a pass would cost more; the others
decide before layer 0 from stored data. Any selector can keep its first `fresh_layers` layers
fresh for every token: every token is computed there and that KV is kept, and only then does
the computation narrow to the selection.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from sglang_hicache_ext.fusion.request import (
    SCORING_COST_SHARE,
    SCORING_MIN_QUESTION_TOKENS,
    SCORING_QUESTION_TOKENS,
    RequestLayout,
)


@dataclass(frozen=True, eq=False)
class CheckLayerState:
    """Activations at the check layer, all post-RoPE at global positions.

    keys/values/queries cover every request token ([N, H, D], recomputed in the real context);
    reused_keys/reused_values are the stored chunk KV at the same layer for the chunk tokens only,
    in request order ([N_chunk, Hkv, D]).
    """

    layer: int
    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    reused_keys: torch.Tensor
    reused_values: torch.Tensor
    scale: float


@dataclass(frozen=True, eq=False)
class SelectionContext:
    """What a selector sees: the request layout and, for check-layer selectors, the activations;
    for selectors with scoring layers, the question's attention to each chunk token [N_chunk]."""

    layout: RequestLayout
    state: CheckLayerState | None = None
    question_attention: torch.Tensor | None = None
    # Scores of this process's heads -> those of every head (`ModelAdapter.combine_scores`).
    combine: Callable[[torch.Tensor], torch.Tensor] | None = None

    def require_state(self, selector: str) -> CheckLayerState:
        """The check layer's activations; a clear error for a selector that ran without them."""
        if self.state is None:
            raise ValueError(f"selector {selector!r} needs check-layer activations")
        return self.state


class Selector(ABC):
    """Strategy picking the chunk tokens to recompute."""

    name: ClassVar[str]
    # Layer whose activations the scores need (None: decided before layer 0 from stored data).
    check_layer: ClassVar[int | None] = None
    # True: each chunk occurrence gets its own share of the budget (offline or positional
    # selections); False: one global top-k over all chunk tokens of the request.
    per_chunk: ClassVar[bool] = False

    def __init__(self, ratio: float, sink_tokens: int = 0, fresh_layers: int = 0) -> None:
        check_ratio(ratio)
        if sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {sink_tokens}")
        if fresh_layers < 0:
            raise ValueError(f"fresh_layers must be >= 0, got {fresh_layers}")
        self.ratio = float(ratio)
        # A chunk prefilled alone makes its first tokens attention sinks; reused as-is they
        # distort every later layer, so they can be put first in the budget (as EPIC does).
        self.sink_tokens = sink_tokens
        # An error in the first layers' KV is inherited by every later layer, and those layers
        # are a small share of the compute: CacheBlend computes layers 0-1 for every token and
        # keeps that KV.
        self.fresh_layers = fresh_layers

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(ratio={self.ratio}, sink_tokens={self.sink_tokens}, "
            f"fresh_layers={self.fresh_layers})"
        )

    # With scoring layers: whether the scoring pass reads the prompt's new text besides the
    # chunks and the question, how many of the question's last tokens it reads at most (None:
    # all; `fusion/request.py`, `question_over_chunks`), and the share of the compute the
    # request's reuse saves that the read may cost (None: no bound).
    scoring_reads_whole_prompt = False
    scoring_question_tokens: int | None = SCORING_QUESTION_TOKENS
    scoring_cost_share: float | None = SCORING_COST_SHARE

    def scoring_layers(self, num_layers: int) -> tuple[int, ...]:
        """Layers whose question attention a scoring pass must measure (none: no pass)."""
        return ()

    def inline_scoring_layers(self, layout: RequestLayout, num_layers: int) -> tuple[int, ...]:
        """Layers at which this request's question attention is measured inside the prefill
        instead of by a scoring pass (none: a pass, if any; never when the scores decide
        nothing): every token is computed up to the last of them, which is the request's check
        layer, and the selection made there."""
        return ()

    def scoring_question_read(self, layout: RequestLayout, num_layers: int) -> int | None:
        """How many of the question's last tokens this request's scoring pass reads (None:
        all of them): at most `scoring_question_tokens`, and no more than costs
        `scoring_cost_share` of what reusing the chunk tokens saves, but not fewer than
        SCORING_MIN_QUESTION_TOKENS. A question token goes through the pass's layers; each
        chunk token left out of the budget skips every layer past the fresh ones."""
        cap = self.scoring_question_tokens
        affordable = self.affordable_question_read(layout, num_layers)
        if cap is None or affordable is None:
            return cap
        return min(cap, max(SCORING_MIN_QUESTION_TOKENS, int(affordable)))

    def affordable_question_read(self, layout: RequestLayout, num_layers: int) -> float | None:
        """How many question tokens a scoring pass may read for `scoring_cost_share` of what
        reusing the chunk tokens saves (None: no bound, or no pass)."""
        layers = self.scoring_layers(num_layers)
        if self.scoring_cost_share is None or not layers:
            return None
        skipped = layout.num_chunk_tokens - self.budget(layout)
        saved = skipped * max(num_layers - self.fresh_layers, 0)
        return self.scoring_cost_share * saved / (max(layers) + 1)

    def budget(self, layout: RequestLayout) -> int:
        """Number of chunk tokens to recompute in this request."""
        return round(self.ratio * layout.num_chunk_tokens)

    def scores_decide(self, layout: RequestLayout) -> bool:
        """Whether the scores choose any of this request's selection: not when the budget is
        none or every chunk token, nor when the chunks' first `sink_tokens`, which go first,
        fill it (then no scoring pass is worth running)."""
        budget = self.budget(layout)
        if budget in (0, layout.num_chunk_tokens):
            return False
        sinks = [min(self.sink_tokens, span.length) for span in layout.spans]
        if self.per_chunk:
            quotas = chunk_quotas([span.length for span in layout.spans], budget)
            return any(quota > sink for quota, sink in zip(quotas, sinks, strict=True))
        return budget > sum(sinks)

    @abstractmethod
    def score(self, ctx: SelectionContext) -> torch.Tensor:
        """Float scores [N_chunk] for the chunk tokens in request order; higher = recompute."""

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        """Sorted, unique global positions of the chunk tokens to recompute."""
        layout = ctx.layout
        chunk_positions = layout.chunk_positions
        budget = self.budget(layout)
        if budget == 0:
            return chunk_positions[:0]
        if budget == layout.num_chunk_tokens:
            return chunk_positions
        if self.scores_decide(layout):
            scores = self.score(ctx).float()
            if ctx.combine is not None:
                scores = ctx.combine(scores)
            scores = scores.cpu()
            if scores.shape != chunk_positions.shape:
                raise ValueError(f"{self.name}: scores shape {tuple(scores.shape)} != chunk tokens")
        else:  # the chunks' first tokens fill the budget, in the order the scores would give
            scores = torch.zeros(chunk_positions.shape)
        if self.sink_tokens:
            local = torch.cat([torch.arange(span.length) for span in layout.spans])
            scores = scores.masked_fill(local < self.sink_tokens, float("inf"))
        top = per_chunk_top(scores, layout, budget) if self.per_chunk else top_k(scores, budget)
        return torch.sort(chunk_positions[top]).values


def check_ratio(ratio: float) -> None:
    """A recompute ratio is a number in [0, 1]; anything else is refused with its value."""
    if not isinstance(ratio, int | float) or not 0.0 <= float(ratio) <= 1.0:
        raise ValueError(f"recompute ratio must be in [0, 1], got {ratio!r}")


def top_k(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` highest scores; ties go to earlier tokens (a stable sort), so
    selections are deterministic."""
    return torch.sort(scores, descending=True, stable=True).indices[:count]


def per_chunk_top(scores: torch.Tensor, layout: RequestLayout, budget: int) -> torch.Tensor:
    """The budget split over chunk occurrences by length, each occurrence's top scores."""
    quotas = chunk_quotas([span.length for span in layout.spans], budget)
    picked = []
    offset = 0
    for span, quota in zip(layout.spans, quotas, strict=True):
        picked.append(top_k(scores[offset : offset + span.length], quota) + offset)
        offset += span.length
    return torch.cat(picked)


def chunk_quotas(lengths: list[int], budget: int) -> list[int]:
    """Split `budget` over chunks in proportion to length (largest remainder, never > length)."""
    total = sum(lengths)
    exact = [budget * n / total for n in lengths]
    quotas = [int(x) for x in exact]
    order = sorted(range(len(lengths)), key=lambda i: exact[i] - quotas[i], reverse=True)
    for i in order[: budget - sum(quotas)]:
        quotas[i] += 1
    return quotas
