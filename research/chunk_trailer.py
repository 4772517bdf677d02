"""A trained trailer per stored chunk (issue 43): k soft rows after every document, distilled
against the model's own full prefill, the base model frozen.

The design is research/README.md's "A trained trailer per chunk":

- each chunk is precomputed after the chat header (`+prefix`, as the default serves it); its
  trailer is `rows` embeddings placed after the document and run through the frozen model
  against the document's rows, so its K/V depend on the document (`trailer_chunk`);
- the student is the fused prefill at `--ratio` with its selection replayed fixed
  (`fused_forward`: the text and the selected chunk tokens computed at every layer over the
  stored rows at their global positions; r = 0 selects nothing). The selection is the server's
  default selector's, run by the real executor on the prompt each step, with the trailer rows
  never selected and not counted in the budget (`trailer_selection.TrailerExcluded`: r stays a share of the
  documents' tokens). The teacher is the full prefill of the same prompt without trailers; the
  loss is KL(teacher || student) over the question and the teacher's greedy answer
  (teacher-forced);
- measured through the real executor (`evaluation/fused_answers.run_method`) on held-out
  questions as the retention harness measures (reuse of plain chunks, the default at the ratio,
  the default with the trailer; `evaluation/retention.summarise`: KL gap closed, whole-answer
  and token agreement, F1 retention, each with its interval). Before training, `fused_forward`
  is checked against the executor (same logits) and its gradient against a finite difference.

    python -m research.chunk_trailer --model smollm2 --train 8 --eval 8 --epochs 20
    python -m research.chunk_trailer --model smollm2 --ratio 0.15 --train 8 --eval 8 --epochs 4 --threads 2
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.fusion_quality import chat_prefix
from benchmarks.fusion_retention import MODELS, SEED, load_model, measure
from benchmarks.retention_chunks import question_segments
from research.differentiable_fusion import attention, fused_forward
from research.trailer_selection import method_selector, selection
from sglang_hicache_ext.evaluation.answer_quality import f1_score
from sglang_hicache_ext.evaluation.fused_answers import run_method
from sglang_hicache_ext.evaluation.hotpotqa import HotpotQAExample, load_hotpotqa
from sglang_hicache_ext.evaluation.retention import summarise
from sglang_hicache_ext.fusion import make_selector
from sglang_hicache_ext.fusion.adapter import ModelAdapter
from sglang_hicache_ext.fusion.chunk import PrecomputedChunk
from sglang_hicache_ext.fusion.request import (
    ChunkSegment,
    Segment,
    TextSegment,
    build_layout,
)

RESULTS = Path(__file__).resolve().parent / "results"
ANSWER_TOKENS = 16
DEV_SEED = 7  # the held-out dev questions of the fidelity work
TRAIN_SEED = 4343  # questions drawn for training, minus every evaluation and dev question


@dataclass
class ChunkContext:
    """A chunk and the per-layer pre-RoPE K/V of the prefix and document it follows."""

    chunk: PrecomputedChunk
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


@torch.no_grad()
def prefix_rows(
    adapter: ModelAdapter, prefix: Sequence[int]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer pre-RoPE K/V of the chat header the `+prefix` chunks were computed after: the
    same for every chunk (causal), so computed once, and the chunk's own stored rows follow."""
    ids = torch.tensor(list(prefix))
    positions = torch.arange(len(ids))
    hidden = adapter.embed(ids)
    keys, values = [], []
    for layer in range(adapter.shape.num_layers):
        q, k, v = adapter.attention_inputs(layer, hidden)
        keys.append(k)
        values.append(v)
        attn = attention(
            adapter.rotate(q, positions, layer),
            adapter.rotate(k, positions, layer),
            v,
            positions,
            positions,
            adapter.attn_scale,
        )
        hidden = adapter.attention_output(layer, hidden, attn)
    return keys, values


def chunk_context(
    chunk: PrecomputedChunk, prefix: tuple[list[torch.Tensor], list[torch.Tensor]]
) -> ChunkContext:
    keys = [torch.cat([p, c]) for p, c in zip(prefix[0], chunk.keys, strict=True)]
    values = [torch.cat([p, c]) for p, c in zip(prefix[1], chunk.values, strict=True)]
    return ChunkContext(chunk, keys, values)


def trailer_chunk(
    adapter: ModelAdapter, context: ChunkContext, trailer: torch.Tensor, pad_id: int
) -> PrecomputedChunk:
    """The chunk with `trailer` [k, hidden] run after it: its rows, then k trailer rows."""
    n_ctx = context.keys[0].shape[0]
    rows = trailer.shape[0]
    q_pos = torch.arange(n_ctx, n_ctx + rows)
    all_pos = torch.arange(n_ctx + rows)
    hidden = trailer
    keys, values = [], []
    for layer in range(adapter.shape.num_layers):
        q, k, v = adapter.attention_inputs(layer, hidden)
        all_k = torch.cat([context.keys[layer], k])
        all_v = torch.cat([context.values[layer], v])
        attn = attention(
            adapter.rotate(q, q_pos, layer),
            adapter.rotate(all_k, all_pos, layer),
            all_v,
            q_pos,
            all_pos,
            adapter.attn_scale,
        )
        hidden = adapter.attention_output(layer, hidden, attn)
        keys.append(torch.cat([context.chunk.keys[layer], k]))
        values.append(torch.cat([context.chunk.values[layer], v]))
    scores = torch.cat(
        [context.chunk.freq_scores, context.chunk.freq_scores.new_zeros((len(keys), rows))], dim=1
    )
    return PrecomputedChunk(
        context.chunk.token_ids + (pad_id,) * rows,
        tuple(keys),
        tuple(values),
        scores,
        context.chunk.alpha,
    )


@dataclass
class Question:
    example: HotpotQAExample
    segments: list[Segment]
    contexts: dict[int, ChunkContext]  # segment index -> its chunk's context
    teacher_answer: tuple[int, ...]
    teacher_logits: torch.Tensor  # [tail tokens, vocab] over the question and the answer
    tail: int  # text tokens after the last chunk, answer included


def prepare(
    adapter: ModelAdapter, tokenizer: Any, example: HotpotQAExample, stop: set[int]
) -> Question:
    segments = question_segments(example, tokenizer, adapter, prefix_chunks=True)
    header = prefix_rows(adapter, tokenizer.encode(chat_prefix(), add_special_tokens=False))
    contexts = {
        i: chunk_context(s.chunk, header)
        for i, s in enumerate(segments)
        if isinstance(s, ChunkSegment)
    }
    full = run_method(adapter, segments, make_selector("full", 1.0), stop, ANSWER_TOKENS)
    answer = tuple(t for t in full.answer if t not in stop) or full.answer[:1]
    last_chunk = max(contexts)
    tail_ids = [t for s in segments[last_chunk + 1 :] for t in s.token_ids] + list(answer)
    ids = [
        t
        for s in segments
        for t in (s.token_ids if isinstance(s, TextSegment) else s.chunk.token_ids)
    ] + list(answer)
    with torch.no_grad():
        teacher = fused_forward(adapter, [TextSegment(tuple(ids))])[-len(tail_ids) :]
    return Question(example, segments, contexts, answer, teacher, len(tail_ids))


def student_segments(
    adapter: ModelAdapter, question: Question, trailer: torch.Tensor | None, pad_id: int
) -> list[Segment]:
    out: list[Segment] = []
    for i, segment in enumerate(question.segments):
        if i in question.contexts and trailer is not None:
            out.append(ChunkSegment(trailer_chunk(adapter, question.contexts[i], trailer, pad_id)))
        else:
            out.append(segment)
    return out


def loss_of(
    adapter: ModelAdapter,
    question: Question,
    trailer: torch.Tensor | None,
    pad_id: int,
    ratio: float = 0.0,
) -> torch.Tensor:
    segments = student_segments(adapter, question, trailer, pad_id)
    rows = 0 if trailer is None else trailer.shape[0]
    selected = selection(adapter, segments, method_selector(ratio, rows))
    logits = fused_forward(adapter, [*segments, TextSegment(question.teacher_answer)], selected)
    student = logits[-question.tail :].log_softmax(-1)
    teacher = question.teacher_logits.log_softmax(-1)
    return (teacher.exp() * (teacher - student)).sum(-1).mean()


def measured(
    adapter: ModelAdapter,
    tokenizer: Any,
    question: Question,
    trailer: torch.Tensor,
    pad_id: int,
    stop: set[int],
    ratio: float,
) -> dict[str, Any]:
    """One held-out question through the real executor, as the retention harness measures it
    (`benchmarks.fusion_retention.measure`: F1, whole-answer and token agreement, KL along the
    full prefill's answer): reuse of plain chunks (the KL gap's reference), the default at
    `ratio` on `+prefix` chunks, and the same with the trailer."""
    example = question.example
    with torch.no_grad():
        full = run_method(
            adapter,
            question.segments,
            make_selector("full", 1.0),
            stop,
            ANSWER_TOKENS,
            keep_caches=True,
        )
        full_text = tokenizer.decode(full.answer, skip_special_tokens=True).strip()
        plain = question_segments(example, tokenizer, adapter)
        rows = trailer.shape[0]
        cases = {
            "reuse": (plain, make_selector("reuse", 0.0)),
            f"default@{ratio:g}": (question.segments, method_selector(ratio, 0)),
            f"trailer@{ratio:g}": (
                student_segments(adapter, question, trailer, pad_id),
                method_selector(ratio, rows),
            ),
        }
        methods = {}
        for name, (segments, selector) in cases.items():
            run = run_method(adapter, segments, selector, stop, ANSWER_TOKENS, full.answer)
            methods[name] = measure(adapter, full, run, tokenizer, example.answer, full_text)
    return {
        "qid": example.qid,
        "full": full_text,
        "f1_full": f1_score(full_text, example.answer),
        "full_prefill_s": full.prefill_s,
        "methods": methods,
    }


def questions_outside(n: int, exclude: set[str]) -> list[HotpotQAExample]:
    pool = load_hotpotqa(n * 4 + len(exclude), seed=TRAIN_SEED)
    return [e for e in pool if e.qid not in exclude][:n]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--train", type=int, default=8)
    parser.add_argument("--eval", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--ratio", type=float, default=0.0, help="recompute ratio (default: r=0)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--check", action="store_true", help="only the exactness/gradient checks")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    random.seed(0)
    torch.set_num_threads(args.threads)
    tokenizer, adapter = load_model(args.model, torch.float32)
    adapter._model.requires_grad_(False)
    stop = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    evaluation = {e.qid for e in load_hotpotqa(200, seed=SEED)}
    dev = load_hotpotqa(12, seed=DEV_SEED)
    picked = questions_outside(args.train + args.eval, evaluation | {e.qid for e in dev})
    began = time.perf_counter()
    train = [prepare(adapter, tokenizer, e, stop) for e in picked[: args.train]]
    held = [prepare(adapter, tokenizer, e, stop) for e in picked[args.train :]]
    prepare_s = time.perf_counter() - began
    weight = adapter._model.get_input_embeddings().weight
    trailer = (weight.mean(0) + weight.std(0) * torch.randn(args.rows, weight.shape[1])).detach()
    trailer.requires_grad_(True)

    # Checks: r = 0 forward equals the executor's; gradient equals a finite difference.
    q0 = train[0]
    chosen = method_selector(args.ratio, args.rows)
    with torch.no_grad():
        segments = student_segments(adapter, q0, trailer, pad_id)
        picked_rows = selection(adapter, segments, chosen)
        mine = fused_forward(adapter, segments, picked_rows)[-1]
        theirs = run_method(adapter, segments, chosen, stop, 1).first_logits
    forward_diff = float((mine - theirs).abs().max())
    loss = loss_of(adapter, q0, trailer, pad_id, args.ratio)
    (grad,) = torch.autograd.grad(loss, trailer)
    index = tuple(int(i) for i in torch.nonzero(grad.abs() == grad.abs().max())[0])
    eps = 1e-3
    with torch.no_grad():
        bumped = trailer.clone()
        bumped[index] += eps
        up = loss_of(adapter, q0, bumped, pad_id, args.ratio)
        bumped[index] -= 2 * eps
        down = loss_of(adapter, q0, bumped, pad_id, args.ratio)
    numeric = float((up - down) / (2 * eps))
    checks = {
        "selected_rows": 0 if picked_rows is None else int(picked_rows.numel()),
        "trailer_rows_selected": 0
        if picked_rows is None
        else sum(
            int(
                (
                    (picked_rows >= s.start + s.length - args.rows)
                    & (picked_rows < s.start + s.length)
                ).sum()
            )
            for s in build_layout(segments).spans
        ),
        "forward_max_abs_diff": forward_diff,
        "grad": float(grad[index]),
        "finite_difference": numeric,
    }
    print(json.dumps(checks))
    if args.check:
        return 0

    optimizer = torch.optim.AdamW([trailer], lr=args.lr, weight_decay=0.0)
    curve = []
    began = time.perf_counter()
    for epoch in range(args.epochs):
        total = 0.0
        for question in random.sample(train, len(train)):
            optimizer.zero_grad()
            loss = loss_of(adapter, question, trailer, pad_id, args.ratio)
            loss.backward()
            optimizer.step()
            total += float(loss.detach())
        curve.append(total / len(train))
        print(f"epoch {epoch + 1}: train KL {curve[-1]:.4f}", flush=True)
    train_s = time.perf_counter() - began
    with torch.no_grad():
        train_kl_plain = sum(
            float(loss_of(adapter, q, None, pad_id, args.ratio)) for q in train
        ) / len(train)
    began = time.perf_counter()
    held_rows = [
        measured(adapter, tokenizer, q, trailer.detach(), pad_id, stop, args.ratio) for q in held
    ]
    eval_s = time.perf_counter() - began
    methods = list(held_rows[0]["methods"])
    summary = summarise(held_rows, methods)
    report = {
        "model": args.model,
        "rows": args.rows,
        "parameters": trailer.numel(),
        "train_questions": args.train,
        "eval_questions": args.eval,
        "epochs": args.epochs,
        "lr": args.lr,
        "ratio": args.ratio,
        "selector": repr(chosen),
        "checks": checks,
        "prepare_s": prepare_s,
        "train_s": train_s,
        "train_kl_curve": curve,
        "train_kl_without_trailer": train_kl_plain,
        "eval_s": eval_s,
        "held_out": summary,
        "held_out_rows": held_rows,
    }
    suffix = "" if args.ratio == 0 else f"_r{args.ratio:g}"
    out = args.out or RESULTS / f"chunk_trailer_{args.model}{suffix}.json"
    out.write_text(json.dumps(report, indent=1))
    torch.save(trailer.detach(), out.with_suffix(".pt"))
    shown = ("train_kl_curve", "held_out_rows")
    print(json.dumps({k: v for k, v in report.items() if k not in shown}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
