"""Study, in process (no server): A3 scoring variants vs baselines on HotpotQA.

Usage: `python -m research.a3_variants N` -> `research/results/a3_variants_N.json`.
Per mode: MiniLM similarity of 16-token greedy answers to the full prefill's, the share of the
reuse -> full gap that closes, exact agreement, and the first-token KL divergence to full.
Not part of the tests; kept so that the figures quoted in docs/fusion-sglang.md reproduce.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.smollm2_in_process import load_smollm2, question_segments
from sglang_hicache_ext.evaluation.answer_quality import embedding_similarity
from sglang_hicache_ext.evaluation.hotpotqa import load_hotpotqa
from sglang_hicache_ext.fusion import generate_greedy, make_selector
from sglang_hicache_ext.fusion.selectors import (
    A3Selector,
    CacheBlendSelector,
    SelectionContext,
    Selector,
    top_k,
)

RESULTS = Path(__file__).resolve().parent / "results"
RATIO = 0.15
ANSWER_TOKENS = 16


class A3QuestionOnly(A3Selector):
    """Question text only: the chat template's closing tokens do not vote."""

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        flags = ctx.layout.is_question.clone()
        flags[torch.nonzero(flags).flatten()[-5:]] = False
        return super().score(replace(ctx, layout=replace(ctx.layout, is_question=flags)))


class A3HeadNormalised(A3Selector):
    """Each head's attention renormalised over chunk tokens: every head gets an equal vote."""

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        logits = self.question_logits(ctx)
        return logits[:, :, ctx.layout.chunk_positions].softmax(-1).sum(dim=(0, 1))


class A3MaxOverHeads(A3Selector):
    """The largest attention any head / question token gives a chunk token."""

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        attention = self.question_logits(ctx).softmax(-1)
        return attention.amax(dim=(0, 1))[ctx.layout.chunk_positions]


class A3OrCacheBlend(A3Selector):
    """Best rank under A3 or under CacheBlend (half the budget each, roughly)."""

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        layout = ctx.layout
        a3_rank = torch.argsort(torch.argsort(-super().score(ctx)))
        blend_rank = torch.argsort(torch.argsort(-CacheBlendSelector(self.ratio).score(ctx)))
        top = top_k(-torch.minimum(a3_rank, blend_rank).float(), self.budget(layout))
        return torch.sort(layout.chunk_positions[top]).values


MODES: dict[str, Callable[[], Selector]] = {
    "reuse": lambda: make_selector("reuse", 0.0),
    "a3": lambda: make_selector("a3", RATIO),
    "cacheblend": lambda: make_selector("cacheblend", RATIO),
    "epic": lambda: make_selector("epic", RATIO),
    "a3_question_only": lambda: A3QuestionOnly(RATIO),
    "a3_head_normalised": lambda: A3HeadNormalised(RATIO),
    "a3_max_over_heads": lambda: A3MaxOverHeads(RATIO),
    "a3_or_cacheblend": lambda: A3OrCacheBlend(RATIO),
    "a3@0.3": lambda: make_selector("a3", 0.3),
}


def main(questions: int) -> None:
    tokenizer, adapter = load_smollm2(threads=1)
    answers: dict[str, list[str]] = {mode: [] for mode in MODES}
    kl: dict[str, list[float]] = {mode: [] for mode in MODES}
    full_answers: list[str] = []
    examples = load_hotpotqa(questions, seed=2026)
    for index, example in enumerate(tqdm(examples, desc="questions", disable=None)):
        segments = question_segments(example, tokenizer, adapter)
        full = generate_greedy(adapter, segments, make_selector("full", 1.0), ANSWER_TOKENS)
        reference = full.first_logits.log_softmax(-1)
        full_answers.append(tokenizer.decode(full.token_ids, skip_special_tokens=True))
        for mode, make in MODES.items():
            run = generate_greedy(adapter, segments, make(), ANSWER_TOKENS)
            logp = run.first_logits.log_softmax(-1)
            kl[mode].append(float((reference.exp() * (reference - logp)).sum()))
            answers[mode].append(tokenizer.decode(run.token_ids, skip_special_tokens=True))
        tqdm.write(f"[{index + 1}/{questions}]")
    summary = {}
    for mode in MODES:
        sims = embedding_similarity(answers[mode], full_answers)
        summary[mode] = {
            "similarity": sum(sims) / len(sims),
            "exact": sum(a == b for a, b in zip(answers[mode], full_answers, strict=True))
            / len(full_answers),
            "first_token_kl": sum(kl[mode]) / len(kl[mode]),
        }
    base = summary["reuse"]["similarity"]
    for mode, row in summary.items():
        row["gap_closed"] = (row["similarity"] - base) / (1 - base)
        print(
            f"{mode:<20} sim {row['similarity']:.3f} gap {row['gap_closed']:.2f} "
            f"exact {row['exact']:.2f} kl {row['first_token_kl']:.3f}"
        )
    out = RESULTS / f"a3_variants_{questions}.json"
    out.write_text(
        json.dumps({"summary": summary, "answers": answers, "full": full_answers}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
