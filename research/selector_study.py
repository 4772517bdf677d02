"""Study, in process: candidate selectors vs A3 / CacheBlend at one ratio, on either model.

Usage: `python -m research.selector_study --model qwen --questions 12`
-> research/results/selector_study_<model>.json. HotpotQA, all paragraphs as chunks shuffled.
Per method: teacher-forced KL to the full prefill, its gap closed vs reuse, exact agreement with
the full prefill's answer, F1. An oracle that ranks chunk tokens by their KV deviation summed
over all layers (known only after a full prefill) shows the headroom of a one-set selection.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.retention_chunks import question_segments
from sglang_hicache_ext.evaluation.answer_quality import f1_score, normalize_answer
from sglang_hicache_ext.evaluation.fused_answers import run_method, teacher_forced_kl
from sglang_hicache_ext.evaluation.hotpotqa import load_hotpotqa
from sglang_hicache_ext.evaluation.model_paths import QWEN_CODER, SMOLLM2, model_dir
from sglang_hicache_ext.fusion import make_selector
from sglang_hicache_ext.fusion.adapters.hf import HFCausalLMAdapter
from sglang_hicache_ext.fusion.executor import fused_prefill
from sglang_hicache_ext.fusion.selectors import (
    A3Selector,
    CacheBlendSelector,
    SelectionContext,
    Selector,
)

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = {"qwen": QWEN_CODER, "smollm2": SMOLLM2}
ANSWER_TOKENS = 24


def question_error(ctx: SelectionContext, key_term: bool = True) -> torch.Tensor:
    """First-order error each reused chunk token puts into the question's attention outputs."""
    state = ctx.state
    assert state is not None
    layout = ctx.layout
    question = torch.nonzero(layout.is_question).flatten()
    chunk = layout.chunk_positions
    q = state.queries[question].float()  # [Q, H, D]
    group = q.shape[1] // state.keys.shape[1]
    k = state.keys.float().repeat_interleave(group, 1)  # [N, H, D]
    v = state.values.float().repeat_interleave(group, 1)
    logits = torch.einsum("qhd,khd->hqk", q, k) * state.scale
    visible = torch.arange(k.shape[0])[None, None, :] <= question[None, :, None]
    attn = logits.masked_fill(~visible, float("-inf")).softmax(-1)  # [H, Q, N]
    out = torch.einsum("hqk,khd->hqd", attn, v)  # [H, Q, D]
    a = attn[:, :, chunk]  # [H, Q, C]
    kc, vc = k[chunk], v[chunk]
    dk = state.reused_keys.float().repeat_interleave(group, 1) - kc  # [C, H, D]
    dv = state.reused_values.float().repeat_interleave(group, 1) - vc
    dv2 = (dv * dv).sum(-1).T[:, None, :]  # [H, 1, C]
    if not key_term:
        return (a * dv2.sqrt()).sum((0, 1))
    b = a * torch.einsum("qhd,chd->hqc", q, dk) * state.scale  # attention logit change x weight
    # || a dv + b (v - o) ||^2 expanded so no [H, Q, C, D] tensor is built.
    dv_v = (dv * vc).sum(-1).T[:, None, :]
    dv_o = torch.einsum("chd,hqd->hqc", dv, out)
    v2 = (vc * vc).sum(-1).T[:, None, :]
    vo = torch.einsum("chd,hqd->hqc", vc, out)
    o2 = (out * out).sum(-1)[:, :, None]
    sq = a * a * dv2 + 2 * a * b * (dv_v - dv_o) + b * b * (v2 - 2 * vo + o2)
    return sq.clamp(min=0).sqrt().sum((0, 1))


class QuestionError(Selector):
    name = "qerr"
    check_layer = 1

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        return question_error(ctx)


class QuestionErrorValueOnly(QuestionError):
    name = "qerr_v"

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        return question_error(ctx, key_term=False)


class RankUnion(Selector):
    """Half the budget by CacheBlend's deviation, half by A3's attention (mean of rank scores)."""

    name = "union"
    check_layer = 1

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        a = A3Selector(self.ratio).score(ctx).float().cpu()
        c = CacheBlendSelector(self.ratio).score(ctx).float().cpu()
        return torch.maximum(_rank01(a), _rank01(c))


class DeviationTimesAttention(Selector):
    name = "dev_x_attn"
    check_layer = 1

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        a = A3Selector(self.ratio).score(ctx).float().cpu()
        c = CacheBlendSelector(self.ratio).score(ctx).float().cpu()
        return a * c


class Oracle(Selector):
    name = "oracle"

    def __init__(self, ratio: float, scores: torch.Tensor) -> None:
        super().__init__(ratio)
        self.scores = scores

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        return self.scores


def _rank01(x: torch.Tensor) -> torch.Tensor:
    order = torch.argsort(torch.argsort(x))
    return order.float() / max(1, x.numel() - 1)


def oracle_scores(adapter, segments) -> torch.Tensor:
    full = fused_prefill(adapter, segments, make_selector("full", 1.0), return_kv=True)
    reuse = fused_prefill(adapter, segments, make_selector("reuse", 0.0), return_kv=True)
    from sglang_hicache_ext.fusion.request import build_layout

    chunk = build_layout(segments).chunk_positions
    total = torch.zeros(chunk.numel())
    for kf, vf, kr, vr in zip(
        full.kv.keys, full.kv.values, reuse.kv.keys, reuse.kv.values, strict=True
    ):
        d = (kf[chunk] - kr[chunk]).flatten(1).norm(dim=-1) + (vf[chunk] - vr[chunk]).flatten(
            1
        ).norm(dim=-1)
        total += d / d.mean()
    return total


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen")
    parser.add_argument("--questions", type=int, default=12)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--methods", default="")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    path = model_dir(MODELS[args.model])
    tokenizer = AutoTokenizer.from_pretrained(path)
    adapter = HFCausalLMAdapter.from_pretrained(str(path))
    stop = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
    r = args.ratio
    factories = {
        "reuse": lambda s: make_selector("reuse", 0.0),
        "a3": lambda s: make_selector("a3", r),
        "cacheblend": lambda s: make_selector("cacheblend", r),
        "a3+sink4": lambda s: make_selector("a3", r, sink_tokens=4),
        "cacheblend+sink4": lambda s: make_selector("cacheblend", r, sink_tokens=4),
        "qerr": lambda s: QuestionError(r),
        "qerr_v": lambda s: QuestionErrorValueOnly(r),
        "qerr+sink4": lambda s: QuestionError(r, sink_tokens=4),
        "union": lambda s: RankUnion(r),
        "dev_x_attn": lambda s: DeviationTimesAttention(r),
        "oracle": lambda s: Oracle(r, oracle_scores(adapter, s)),
    }
    if args.methods:
        factories = {m: factories[m] for m in args.methods.split(",")}
    out = RESULTS / f"selector_study_{args.model}.json"
    rows = []
    for example in load_hotpotqa(args.questions, seed=2026):
        began = time.perf_counter()
        segments = question_segments(example, tokenizer, adapter)
        full = run_method(adapter, segments, make_selector("full", 1.0), stop, ANSWER_TOKENS)
        full_text = tokenizer.decode(full.answer, skip_special_tokens=True).strip()
        row = {
            "qid": example.qid,
            "gold": example.answer,
            "full": full_text,
            "f1_full": f1_score(full_text, example.answer),
            "methods": {},
        }
        for name, factory in factories.items():
            run = run_method(adapter, segments, factory(segments), stop, ANSWER_TOKENS, full.answer)
            text = tokenizer.decode(run.answer, skip_special_tokens=True).strip()
            row["methods"][name] = {
                "answer": text,
                "f1": f1_score(text, example.answer),
                "agree": normalize_answer(text) == normalize_answer(full_text),
                "kl": teacher_forced_kl(full, run),
            }
        rows.append(row)
        out.write_text(json.dumps(rows, indent=1))
        print(
            f"q{len(rows)} {time.perf_counter() - began:.0f}s full={full_text!r} gold={example.answer!r}",
            flush=True,
        )
    names = list(factories)
    kl_reuse = (
        statistics.mean(row["methods"]["reuse"]["kl"] for row in rows) if "reuse" in names else None
    )
    f1_full = statistics.mean(row["f1_full"] for row in rows)
    print(f"full F1 {f1_full:.3f}")
    for name in names:
        kl = statistics.mean(row["methods"][name]["kl"] for row in rows)
        f1 = statistics.mean(row["methods"][name]["f1"] for row in rows)
        agree = statistics.mean(row["methods"][name]["agree"] for row in rows)
        gap = 1 - kl / kl_reuse if kl_reuse else float("nan")
        print(
            f"{name:<18} KL {kl:.4f} gap {gap:.2f} agree {agree:.2f} F1 {f1:.3f} ret {f1 / max(f1_full, 1e-9):.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
