"""The question's attention over several middle layers, measured by a scoring pass."""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from sglang_hicache_ext.fusion.request import SCORING_COST_SHARE, SCORING_QUESTION_TOKENS
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
    """

    name = "question_attention"
    DEFAULT_LAYERS: ClassVar[tuple[float, float]] = (0.25, 0.75)

    def __init__(
        self,
        ratio: float,
        sink_tokens: int = 0,
        fresh_layers: int = 0,
        layers: tuple[float, float] = DEFAULT_LAYERS,
        whole_prompt: bool = False,
        question_tokens: int | None = SCORING_QUESTION_TOKENS,
        cost_share: float | None = SCORING_COST_SHARE,
    ) -> None:
        super().__init__(ratio, sink_tokens, fresh_layers)
        self.scoring_reads_whole_prompt = whole_prompt
        if question_tokens is not None and question_tokens < 1:
            raise ValueError(f"question_tokens must be >= 1 or None, got {question_tokens}")
        self.scoring_question_tokens = question_tokens
        if cost_share is not None and not 0.0 < cost_share <= 1.0:
            raise ValueError(f"cost_share must be in (0, 1] or None, got {cost_share}")
        self.scoring_cost_share = cost_share
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
