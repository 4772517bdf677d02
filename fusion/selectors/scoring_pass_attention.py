"""The question's attention over several middle layers, measured by a scoring pass."""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from sglang_hicache_ext.fusion.request import (
    SCORING_COST_SHARE,
    SCORING_MIN_QUESTION_TOKENS,
    SCORING_PASS_ROW_COST,
    SCORING_QUESTION_TOKENS,
    RequestLayout,
)
from sglang_hicache_ext.fusion.selectors.base import SelectionContext, Selector


class QuestionAttentionSelector(Selector):
    """The question's softmax attention to each chunk token, summed over heads, question tokens
    and several layers, measured by a scoring pass of the question over the reused KV at the
    chunks' final positions (ProphetKV, QCFuse; InfoFlow scores at final positions too).

    One check layer (A3) sees attention that mostly tracks distance and sink tokens; the middle
    layers are where a question reads the content it needs. `layers` is a [start, end) range as
    fractions of the model's depth, so one setting serves models of any depth.

    The scoring pass reads the chunks, the question and the exact prefix (`whole_prompt` False,
    the default): the prompt's other new text is computed by the prefill at every layer anyway,
    and read here too it would cost a prompt half new nearly its new half again
    (docs/auto-chunks.md, "When fusion does not pay"). `whole_prompt` True reads every token.
    `question_tokens`: how many of the question's last tokens the pass reads at most (None:
    all); a prompt's text after its last chunk is its question when none is marked, and may be
    new paragraphs before the question itself. `cost_share`: the read costs at most this share
    of the compute the request's reuse saves (None: no bound; `Selector.scoring_question_read`).

    `inline_layers` ([start, end) fractions, None: always a pass): a request whose reuse cannot
    afford the pass's smallest read (SCORING_MIN_QUESTION_TOKENS within `cost_share`), and for
    which computing its chunk tokens up to these layers costs less than that read, has its
    question's attention measured inside the prefill at these layers instead: every token is
    computed up to the last of them (exact KV there), and the selection narrows the rows after it.
    """

    name = "question_attention"
    DEFAULT_LAYERS: ClassVar[tuple[float, float]] = (0.25, 0.75)
    # The first half of that range: on the low-share Qwen prompts every answer was kept, where
    # stopping earlier lost one (docs/fusion-quality.md, "What the scoring pass reads").
    DEFAULT_INLINE_LAYERS: ClassVar[tuple[float, float]] = (0.25, 0.5)

    def __init__(
        self,
        ratio: float,
        sink_tokens: int = 0,
        fresh_layers: int = 0,
        layers: tuple[float, float] = DEFAULT_LAYERS,
        whole_prompt: bool = False,
        question_tokens: int | None = SCORING_QUESTION_TOKENS,
        cost_share: float | None = SCORING_COST_SHARE,
        inline_layers: tuple[float, float] | None = DEFAULT_INLINE_LAYERS,
    ) -> None:
        super().__init__(ratio, sink_tokens, fresh_layers)
        self.scoring_reads_whole_prompt = whole_prompt
        if question_tokens is not None and question_tokens < 1:
            raise ValueError(f"question_tokens must be >= 1 or None, got {question_tokens}")
        self.scoring_question_tokens = question_tokens
        if cost_share is not None and not 0.0 < cost_share <= 1.0:
            raise ValueError(f"cost_share must be in (0, 1] or None, got {cost_share}")
        self.scoring_cost_share = cost_share
        self.layers = _fractions(layers)
        self.inline_layers = None if inline_layers is None else _fractions(inline_layers)

    def scoring_layers(self, num_layers: int) -> tuple[int, ...]:
        return _layer_range(self.layers, num_layers)

    def inline_scoring_layers(self, layout: RequestLayout, num_layers: int) -> tuple[int, ...]:
        read = self.scoring_question_read(layout, num_layers)
        affordable = self.affordable_question_read(layout, num_layers)
        if self.inline_layers is None or read is None or affordable is None:
            return ()
        if affordable >= SCORING_MIN_QUESTION_TOKENS or not self.scores_decide(layout):
            return ()  # the pass's read fits in what reuse saves, or no scores are needed
        inline = _layer_range(self.inline_layers, num_layers)
        question = int(layout.is_question.sum())
        pass_layers = max(self.scoring_layers(num_layers)) + 1
        pass_cost = SCORING_PASS_ROW_COST * min(read, question) * pass_layers
        # Inline, a chunk token left out of the budget is computed up to the last inline layer.
        skipped = layout.num_chunk_tokens - self.budget(layout)
        return inline if skipped * (max(inline) + 1) < pass_cost else ()

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        if ctx.question_attention is None:
            raise ValueError(f"{self.name!r} needs the question's attention (a pass or inline)")
        return ctx.question_attention


def _fractions(layers: tuple[float, float]) -> tuple[float, float]:
    start, end = layers
    if not 0.0 <= start < end <= 1.0:
        raise ValueError(f"scoring layers must satisfy 0 <= start < end <= 1, got {layers}")
    return float(start), float(end)


def _layer_range(layers: tuple[float, float], num_layers: int) -> tuple[int, ...]:
    """[start, end) fractions of the depth -> layer indices (at least one)."""
    first = min(math.floor(layers[0] * num_layers), num_layers - 1)
    return tuple(range(first, max(first + 1, math.ceil(layers[1] * num_layers))))
