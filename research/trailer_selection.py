"""Which chunk rows a prompt with trailers recomputes (research/chunk_trailer.py): the server's
default selector at a ratio, the trailer rows never selected and not counted in the budget, so
r stays a share of the documents' tokens; and the executor's choice, replayed fixed in the
differentiable forward (`differentiable_fusion.fused_forward`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from benchmarks.retention_methods import DEFAULT_SELECTOR, DEFAULT_SINK_TOKENS
from sglang_hicache_ext.fusion import make_selector
from sglang_hicache_ext.fusion.adapter import ModelAdapter
from sglang_hicache_ext.fusion.executor import fused_prefill
from sglang_hicache_ext.fusion.request import RequestLayout, Segment
from sglang_hicache_ext.fusion.selectors import SelectionContext, Selector


class TrailerExcluded(Selector):
    """`inner`'s choice with every chunk's last `rows` rows (its trailer) never selected and not
    counted in the budget, so r keeps its meaning: a share of the documents' tokens."""

    def __init__(self, inner: Selector, rows: int) -> None:
        super().__init__(inner.ratio, inner.sink_tokens, inner.fresh_layers)
        self.inner, self.rows = inner, rows
        self.name = inner.name  # type: ignore[misc]
        self.check_layer = inner.check_layer  # type: ignore[misc]
        self.per_chunk = inner.per_chunk  # type: ignore[misc]

    def scoring_layers(self, num_layers: int) -> tuple[int, ...]:
        return self.inner.scoring_layers(num_layers)

    def budget(self, layout: RequestLayout) -> int:
        documents = layout.num_chunk_tokens - self.rows * len(layout.spans)
        return round(self.ratio * documents)

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        scores = self.inner.score(ctx).float()
        trailer = torch.cat(
            [torch.arange(span.length) >= span.length - self.rows for span in ctx.layout.spans]
        )
        return scores.masked_fill(trailer.to(scores.device), float("-inf"))


def method_selector(ratio: float, trailer_rows: int) -> Selector:
    """The server's default selector at `ratio` (reuse at 0); with a trailer, never its rows."""
    if ratio == 0:
        return make_selector("reuse", 0.0)
    inner = make_selector(DEFAULT_SELECTOR, ratio, sink_tokens=DEFAULT_SINK_TOKENS)
    return TrailerExcluded(inner, trailer_rows) if trailer_rows else inner


def selection(
    adapter: ModelAdapter, segments: Sequence[Segment], selector: Selector
) -> torch.Tensor | None:
    """The executor's choice on the prompt (no gradient through it: replayed fixed)."""
    if selector.ratio == 0:
        return None
    return fused_prefill(adapter, segments, selector).selected.cpu()
