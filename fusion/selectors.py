"""Which chunk tokens to recompute: strategies behind one `score()` / `select()` contract.

Every selector scores the chunk tokens of a request (higher = recompute first) and `select()`
turns scores into a fixed budget of round(ratio x chunk tokens) global positions. Selectors with
a `check_layer` score from that layer's activations (the executor computes every token up to
it); selectors with `scoring_layers` score from the question's attention in a scoring pass run
before the prefill (the question over the reused KV, `fusion/executor.py`); the others
decide before layer 0 from stored data. Any selector can keep its first `fresh_layers` layers
fresh for every token: every token is computed there and that KV is kept, and only then does
the computation narrow to the selection.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from sglang_hicache_ext.fusion.request import RequestLayout


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


class Selector(ABC):
    """Strategy picking the chunk tokens to recompute."""

    name: ClassVar[str]
    # Layer whose activations the scores need (None: decided before layer 0 from stored data).
    check_layer: ClassVar[int | None] = None
    # True: each chunk occurrence gets its own share of the budget (offline or positional
    # selections); False: one global top-k over all chunk tokens of the request.
    per_chunk: ClassVar[bool] = False

    def __init__(self, ratio: float, sink_tokens: int = 0, fresh_layers: int = 0) -> None:
        _check_ratio(ratio)
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

    def scoring_layers(self, num_layers: int) -> tuple[int, ...]:
        """Layers whose question attention a scoring pass must measure (none: no pass)."""
        return ()

    def budget(self, layout: RequestLayout) -> int:
        """Number of chunk tokens to recompute in this request."""
        return round(self.ratio * layout.num_chunk_tokens)

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
        scores = self.score(ctx).float()
        if ctx.combine is not None:
            scores = ctx.combine(scores)
        scores = scores.cpu()
        if scores.shape != chunk_positions.shape:
            raise ValueError(f"{self.name}: scores shape {tuple(scores.shape)} != chunk tokens")
        if self.sink_tokens:
            local = torch.cat([torch.arange(span.length) for span in layout.spans])
            scores = scores.masked_fill(local < self.sink_tokens, float("inf"))
        top = _per_chunk_top(scores, layout, budget) if self.per_chunk else _top(scores, budget)
        return torch.sort(chunk_positions[top]).values


class _FixedRatioSelector(Selector):
    """A selector whose ratio is fixed: a given one is only validated, every token scores it."""

    fixed_ratio: ClassVar[float]

    def __init__(
        self, ratio: float | None = None, sink_tokens: int = 0, fresh_layers: int = 0
    ) -> None:
        super().__init__(self.fixed_ratio if ratio is None else ratio, sink_tokens, fresh_layers)
        self.ratio = self.fixed_ratio

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        return torch.full((ctx.layout.num_chunk_tokens,), self.fixed_ratio)


class FullSelector(_FixedRatioSelector):
    """Normal prefill: every chunk token is recomputed (ratio is forced to 1)."""

    name = "full"
    fixed_ratio = 1.0


class ReuseSelector(_FixedRatioSelector):
    """Pure reuse: nothing recomputed (ratio is forced to 0)."""

    name = "reuse"
    fixed_ratio = 0.0


class RandomSelector(Selector):
    """Uniformly random tokens (seeded, so runs are reproducible)."""

    name = "random"

    def __init__(
        self, ratio: float, seed: int = 0, sink_tokens: int = 0, fresh_layers: int = 0
    ) -> None:
        super().__init__(ratio, sink_tokens, fresh_layers)
        self.seed = seed

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed)
        return torch.rand(ctx.layout.num_chunk_tokens, generator=generator)


class EpicSelector(Selector):
    """EPIC: the first tokens of each chunk (attention sinks at chunk starts)."""

    name = "epic"
    per_chunk = True

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        local = [torch.arange(span.length, dtype=torch.float32) for span in ctx.layout.spans]
        return -torch.cat(local)


class FrequencySelector(Selector):
    """CacheTune: offline low-frequency energy scores stored with each chunk.

    One index set serves every layer (a token recomputed at layer l needs its layer l-1 state),
    so per-layer scores are averaged, or one `layer`'s scores are used.
    """

    name = "freq"
    per_chunk = True

    def __init__(
        self, ratio: float, layer: int | None = None, sink_tokens: int = 0, fresh_layers: int = 0
    ) -> None:
        super().__init__(ratio, sink_tokens, fresh_layers)
        self.layer = layer

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        parts = []
        for span in ctx.layout.spans:
            scores = span.chunk.freq_scores.float().cpu()
            parts.append(scores.mean(0) if self.layer is None else scores[self.layer])
        return torch.cat(parts)


class A3Selector(Selector):
    """A3: softmax attention of question tokens over chunk tokens at layer 1, summed."""

    name = "a3"
    check_layer = 1

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        per_token = self.question_logits(ctx).softmax(dim=-1).sum(dim=(0, 1))
        return per_token[ctx.layout.chunk_positions.to(per_token.device)]

    def question_logits(self, ctx: SelectionContext) -> torch.Tensor:
        """Scaled q.k [heads, question tokens, keys] at the check layer; -inf for later keys."""
        state = _require_state(ctx, self.name)
        question = torch.nonzero(ctx.layout.is_question).flatten().to(state.queries.device)
        if question.numel() == 0:
            raise ValueError("a3 needs question tokens (a TextSegment after the chunks)")
        return question_logits(state.queries[question], question, state.keys, state.scale)


class QuestionAttentionSelector(Selector):
    """The question's softmax attention to each chunk token, summed over heads, question tokens
    and several layers, measured by a scoring pass of the question over the reused KV at the
    chunks' final positions (ProphetKV, QCFuse; InfoFlow scores at final positions too).

    One check layer (A3) sees attention that mostly tracks distance and sink tokens; the middle
    layers are where a question reads the content it needs. `layers` is a [start, end) range as
    fractions of the model's depth, so one setting serves models of any depth.
    """

    name = "question_attention"
    DEFAULT_LAYERS: ClassVar[tuple[float, float]] = (0.25, 0.75)

    def __init__(
        self,
        ratio: float,
        sink_tokens: int = 0,
        fresh_layers: int = 0,
        layers: tuple[float, float] = DEFAULT_LAYERS,
    ) -> None:
        super().__init__(ratio, sink_tokens, fresh_layers)
        start, end = layers
        if not 0.0 <= start < end <= 1.0:
            raise ValueError(f"scoring layers must satisfy 0 <= start < end <= 1, got {layers}")
        self.layers = (float(start), float(end))

    def scoring_layers(self, num_layers: int) -> tuple[int, ...]:
        first = min(math.floor(self.layers[0] * num_layers), num_layers - 1)
        return tuple(range(first, max(first + 1, math.ceil(self.layers[1] * num_layers))))

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        if ctx.question_attention is None:
            raise ValueError(f"selector {self.name!r} needs a scoring pass")
        return ctx.question_attention


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


class CacheBlendSelector(Selector):
    """CacheBlend: largest K/V deviation between recomputed and reused KV at layer 1."""

    name = "cacheblend"
    check_layer = 1

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        state = _require_state(ctx, self.name)
        chunk = ctx.layout.chunk_positions.to(state.keys.device)
        dk = (state.keys[chunk].float() - state.reused_keys.float()).flatten(1).norm(dim=-1)
        dv = (state.values[chunk].float() - state.reused_values.float()).flatten(1).norm(dim=-1)
        return dk + dv


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
        state = _require_state(ctx, self.name)
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


SELECTORS: dict[str, type[Selector]] = {
    cls.name: cls
    for cls in (
        QuestionErrorSelector,
        QuestionAttentionSelector,
        A3Selector,
        FrequencySelector,
        CacheBlendSelector,
        EpicSelector,
        RandomSelector,
        ReuseSelector,
        FullSelector,
    )
}


def make_selector(name: str, ratio: float, **options: object) -> Selector:
    """Selector by name (see SELECTORS); `full` and `reuse` ignore ratio beyond validating it."""
    _check_ratio(ratio)
    if name not in SELECTORS:
        raise ValueError(f"unknown selector {name!r}; choose from {sorted(SELECTORS)}")
    return SELECTORS[name](ratio, **options)  # type: ignore[arg-type]


def _check_ratio(ratio: float) -> None:
    if not isinstance(ratio, int | float) or not 0.0 <= float(ratio) <= 1.0:
        raise ValueError(f"recompute ratio must be in [0, 1], got {ratio!r}")


def _require_state(ctx: SelectionContext, name: str) -> CheckLayerState:
    if ctx.state is None:
        raise ValueError(f"selector {name!r} needs check-layer activations")
    return ctx.state


def _sq_norm(x: torch.Tensor) -> torch.Tensor:
    """[C, H, D] -> squared norms [H, C]."""
    return (x * x).sum(-1).T


def _top(scores: torch.Tensor, count: int) -> torch.Tensor:
    # Stable sort: ties go to earlier tokens, so selections are deterministic.
    return torch.sort(scores, descending=True, stable=True).indices[:count]


def _per_chunk_top(scores: torch.Tensor, layout: RequestLayout, budget: int) -> torch.Tensor:
    quotas = _quotas([span.length for span in layout.spans], budget)
    picked = []
    offset = 0
    for span, quota in zip(layout.spans, quotas, strict=True):
        picked.append(_top(scores[offset : offset + span.length], quota) + offset)
        offset += span.length
    return torch.cat(picked)


def _quotas(lengths: list[int], budget: int) -> list[int]:
    """Split `budget` over chunks in proportion to length (largest remainder, never > length)."""
    total = sum(lengths)
    exact = [budget * n / total for n in lengths]
    quotas = [int(x) for x in exact]
    order = sorted(range(len(lengths)), key=lambda i: exact[i] - quotas[i], reverse=True)
    for i in order[: budget - sum(quotas)]:
        quotas[i] += 1
    return quotas
