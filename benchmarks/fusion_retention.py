"""Does fusion keep the model's answers? F1 retention and fidelity per selector and ratio.

In process (the fusion executor over transformers' modules; the server reproduces the executor's
answers exactly, docs/fusion-sglang.md), HotpotQA distractor questions, every paragraph of a
question registered as a chunk and the paragraphs shuffled in the prompt (ChatML, the same prompt
as benchmarks/fusion_quality.py). Per question, every method on the same prompt:

- the greedy answer (stopped at <|im_end|>, at most 16 tokens): token F1 against the gold answer,
  and agreement with the full prefill's answer (equal after HotpotQA normalisation);
- the teacher-forced KL to the full prefill along the full prefill's answer, and the first-token KL;
- token agreement, the measure of the server's live shadow check: the method's own answer
  teacher-forced through the full prefill, the share of its tokens that are the full prefill's
  greedy choice there (evaluation/token_agreement.py), and whether the first token is;
- the prefill's wall time, as a ratio to the full prefill's on the same prompt.

Summary per method: F1 retention = mean F1 / mean F1 of the full prefill with a 95 % paired
bootstrap interval (scipy.stats.bootstrap, BCa); answers kept = of the questions the full prefill
answers (F1 >= 0.5), the share the method still answers (with a bootstrap interval), and answers
gained (questions only the method answers: a weak model's F1 moves both ways, and gains by chance
inflate the mean F1 without keeping anything); agreement, teacher-forced KL and the share of
reuse's KL it closes (`kl_gap_closed`, also with a bootstrap interval), median prefill-time ratio.

    python -m benchmarks.fusion_retention --model qwen --questions 200 \
        --methods reuse,default@0.15,a3@0.15,cacheblend@0.15 [--resume]
-> benchmarks/results/fusion_retention_<model>.json (rewritten after every question).
A method is `full`, `reuse`, or `<selector>[+sink<N>]@<ratio>`, with the modifiers of
`benchmarks/retention_methods.py` (`+prefix`, `+fresh<F>`, `+layers<a>-<b>`, `+ape`, and the noise
floors `full+batch` / `full+fp32`); `default` is the server's default selector; `<method>#<codec>` (e.g. `default@0.15#int8`) runs it on chunks stored through a codec
(`tiers/chunks/codecs`: int8, int4); `<method>:keep<C>` (e.g. `default@0.15:keep0.25`) decodes with
only C of the prompt's tokens kept per layer and head after the prefill (decode-time eviction,
`fusion/decode_eviction.py`). `--min-prompt-tokens N` pads every prompt with paragraphs of the
other sampled questions (also chunks) until it has N tokens. `--resume` adds missing questions
and methods to an earlier file (a question whose full prefill answers otherwise now, as
another CPU's bf16 kernels can, has every asked method measured again).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.fusion_quality import chatml_prompt
from benchmarks.retention_chunks import question_segments
from benchmarks.retention_methods import (
    DEFAULT_SELECTOR,
    DEFAULT_SINK_TOKENS,
    parse_method,
    split_codec,
    split_keep,
)
from benchmarks.retention_summary import print_table
from benchmarks.smollm2_server import RESULTS
from sglang_hicache_ext.evaluation.answer_quality import f1_score, normalize_answer
from sglang_hicache_ext.evaluation.fused_answers import (
    MethodRun,
    greedy_along,
    kl_divergence,
    run_method,
    teacher_forced_kl,
)
from sglang_hicache_ext.evaluation.hotpotqa import HotpotQAExample, load_hotpotqa
from sglang_hicache_ext.evaluation.model_paths import QWEN_CODER, SMOLLM2, prepared_model
from sglang_hicache_ext.evaluation.retention import summarise
from sglang_hicache_ext.evaluation.token_agreement import token_agreement
from sglang_hicache_ext.fusion import make_selector
from sglang_hicache_ext.fusion.adapters.hf import HFCausalLMAdapter
from sglang_hicache_ext.fusion.request import Segment, build_layout
from sglang_hicache_ext.tuning.ratio.quality_floor import (
    FLOORS_FILE,
    TARGET_RETENTION,
    QualityFloor,
    floor_from_curve,
    ratio_curve,
    record_floor,
)

MODELS = {"qwen": QWEN_CODER, "smollm2": SMOLLM2}
PREPARE = {"qwen": "make models-qwen", "smollm2": "make models"}
ANSWER_TOKENS = 16
SEED = 2026  # question sample: the same questions for every model and method
DTYPES = ("float32", "bfloat16")


def load_model(name: str, dtype: torch.dtype) -> tuple[Any, HFCausalLMAdapter]:
    from transformers import AutoTokenizer

    path = prepared_model(MODELS[name])
    if path is None:
        raise SystemExit(f"{MODELS[name]} is not prepared: run `{PREPARE[name]}`")
    return AutoTokenizer.from_pretrained(path), HFCausalLMAdapter.from_pretrained(str(path), dtype)


def padded(
    example: HotpotQAExample, others: list[HotpotQAExample], tokenizer: Any, min_tokens: int
) -> HotpotQAExample:
    """The example with paragraphs of `others` added (drawn by its qid) until its prompt has
    `min_tokens` tokens: a long RAG prompt whose extra documents do not answer the question."""
    if not min_tokens:
        return example
    pool = [doc for other in others if other.qid != example.qid for doc in other.documents]
    extra = random.Random(example.qid).sample(pool, len(pool))
    documents = list(example.documents)
    while len(tokenizer.encode(chatml_prompt(documents, example.question))) < min_tokens:
        if not extra:
            raise SystemExit(f"too few paragraphs to pad {example.qid} to {min_tokens} tokens")
        documents.append(extra.pop())
    return replace(example, documents=tuple(documents))


def measure(
    adapter: HFCausalLMAdapter,
    full: MethodRun,
    run: MethodRun,
    tokenizer: Any,
    gold: str,
    full_text: str,
) -> dict[str, Any]:
    text = tokenizer.decode(run.answer, skip_special_tokens=True).strip()
    # The live shadow check's measure (evaluation/token_agreement.py): the method's own answer
    # teacher-forced through the full prefill, its greedy choice compared at every token.
    agreement = token_agreement(run.answer, greedy_along(adapter, full, run.answer))
    return {
        "answer": text,
        "f1": f1_score(text, gold),
        "agree": normalize_answer(text) == normalize_answer(full_text),
        "token_agreement": agreement.token_agreement,
        "first_token_agree": agreement.first_token,
        "served_tokens": agreement.tokens,
        "kl": teacher_forced_kl(full, run),
        "first_kl": kl_divergence(full.first_logits, run.first_logits),
        "prefill_s": run.prefill_s,
        # Read inside the fused prefill, for the per-request guard's study (issue 41).
        "signals": run.signals,
    }


def write_summary(
    out: Path, model: str, dtype: str, rows: list[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Summarise over the questions that have every method; print the table."""
    methods = list(dict.fromkeys(m for row in rows for m in row["methods"]))
    summary = summarise(rows, methods)
    report = {
        "model": MODELS[model],
        "dtype": dtype,
        "answer_tokens": ANSWER_TOKENS,
        "default_selector": f"{DEFAULT_SELECTOR}+sink{DEFAULT_SINK_TOKENS}",
        "summary": summary,
        "rows": rows,
    }
    out.write_text(json.dumps(report, indent=1) + "\n")
    print_table(summary)
    return summary


def record_model_floor(
    summary: dict[str, dict[str, Any]], model: str, selector: str, dtype: str, out: Path
) -> None:
    """Store the model's quality floor (tuning/ratio) from `selector`'s ratio curve."""
    curve = ratio_curve(summary, selector)
    if not curve:
        raise SystemExit(f"no {selector}@<ratio> method in {out}")
    floor = QualityFloor(
        MODELS[model], selector, floor_from_curve(curve), TARGET_RETENTION, curve, dtype, out.name
    )
    record_floor(floor)
    print(f"quality floor of {floor.model} ({selector}): {floor.ratio} -> {FLOORS_FILE}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen")
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--methods", default="reuse,default@0.15,a3@0.15,cacheblend@0.15")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="compute dtype of the model (bfloat16: as served on GPU, ~2x faster on AVX512-BF16)",
    )
    parser.add_argument(
        "--seed", type=int, default=SEED, help="question sample (another seed: a held-out dev set)"
    )
    parser.add_argument("--min-prompt-tokens", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument(
        "--full-signals",
        action="store_true",
        help="with --resume, also run the full prefill of rows measured before its first-token "
        "signals were recorded (the control of research/fidelity_signals_study.py)",
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--summary-only", action="store_true", help="summarise the file's rows, measure nothing"
    )
    parser.add_argument(
        "--record-floor",
        metavar="SELECTOR",
        help="store the model's quality floor from this selector's ratio curve (tuning/ratio)",
    )
    args = parser.parse_args()
    methods = [m for m in args.methods.split(",") if m != "full"]
    parsed = {m: parse_method(split_codec(m)[0]) for m in methods}
    # Chunk sets other than the plain one: (codec, precomputed after the prefix, from traffic).
    variants = {
        (
            split_codec(m)[1],
            parsed[m].prefix_chunks,
            parsed[m].traffic_chunks,
            parsed[m].mixed_traffic,
            parsed[m].new_paragraphs,
        )
        for m in methods
    } - {(None, False, False, False, 0.0)}
    suffix = ("" if args.dtype == "float32" else f"_{args.dtype}") + (
        "" if args.seed == SEED else f"_seed{args.seed}"
    )
    out = args.out or RESULTS / f"fusion_retention_{args.model}{suffix}.json"
    if args.summary_only:
        report = json.loads(out.read_text())
        dtype = report.get("dtype", "float32")
        summary = write_summary(out, args.model, dtype, report["rows"])
        if args.record_floor:
            record_model_floor(summary, args.model, args.record_floor, dtype, out)
        return 0
    torch.set_num_threads(args.threads)
    tokenizer, adapter = load_model(args.model, getattr(torch, args.dtype))
    other_dtype = None  # the float32 model of the `full+fp32` noise floor, loaded when asked
    stop = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
    earlier = json.loads(out.read_text()) if args.resume and out.exists() else {"rows": []}
    if earlier.get("dtype", args.dtype) != args.dtype:
        raise SystemExit(f"{out} was measured in {earlier['dtype']}, not {args.dtype}")
    rows: list[dict[str, Any]] = earlier["rows"]
    by_qid = {row["qid"]: row for row in rows}
    examples = load_hotpotqa(args.questions, seed=args.seed)
    companion: list[Segment] | None = None  # the `full+batch` noise floor's other prompt
    for position, example in enumerate(tqdm(examples, desc=args.model, disable=None)):
        example = padded(example, examples, tokenizer, args.min_prompt_tokens)
        row = by_qid.get(example.qid)
        missing = [m for m in methods if row is None or m not in row["methods"]]
        if not missing and not (args.full_signals and "full_signals" not in row):
            continue
        began = time.perf_counter()
        segments = question_segments(example, tokenizer, adapter)
        full = run_method(
            adapter, segments, make_selector("full", 1.0), stop, ANSWER_TOKENS, keep_caches=True
        )
        full_text = tokenizer.decode(full.answer, skip_special_tokens=True).strip()
        if row is not None and row["full"] != full_text:
            # Another CPU's bf16 kernels can flip a near-tie: every method of this question is
            # measured again here against this full prefill (a row stays one run's).
            tqdm.write(f"{example.qid}: the full prefill's answer changed; measuring it anew")
            rows.remove(row)
            row, missing = None, methods
        if row is None:
            row = {
                "qid": example.qid,
                "gold": example.answer,
                "full": full_text,
                "f1_full": f1_score(full_text, example.answer),
                "methods": {},
            }
            row["prompt_tokens"] = build_layout(segments).num_tokens
            rows.append(row)
            by_qid[example.qid] = row
        row["full_prefill_s"] = full.prefill_s
        # The full prefill's own first-token entropy and margin: the study's control (is a
        # fused prefill's uncertainty the fusion's, or the question's?).
        row["full_signals"] = full.signals
        chunk_sets = {(None, False, False, False, 0.0): segments}
        # The first prompt an `auto_chunks` server sees these paragraphs in asks another question
        # (with `mixed`, among that question's paragraphs).
        other = examples[(position + 1) % len(examples)]
        for codec, prefix, traffic, mixed, new in variants if missing else ():
            chunk_sets[codec, prefix, traffic, mixed, new] = question_segments(
                example,
                tokenizer,
                adapter,
                codec,
                prefix,
                other.question if traffic else None,
                other.documents if mixed else (),
                new,
            )
        for method in missing:
            spec = parsed[method]
            model = adapter
            if spec.noise == "fp32":
                other_dtype = other_dtype or load_model(args.model, torch.float32)[1]
                model = other_dtype
            run = run_method(
                model,
                chunk_sets[
                    split_codec(method)[1],
                    spec.prefix_chunks,
                    spec.traffic_chunks,
                    spec.mixed_traffic,
                    spec.new_paragraphs,
                ],
                spec.selector,
                stop,
                ANSWER_TOKENS,
                full.answer,
                split_keep(method)[1],
                spec.tempering,
                (companion or segments) if spec.noise == "batch" else None,
            )
            row["methods"][method] = measure(
                adapter, full, run, tokenizer, example.answer, full_text
            )
        companion = segments
        partial = {"model": MODELS[args.model], "dtype": args.dtype, "rows": rows}
        out.write_text(json.dumps(partial, indent=1) + "\n")
        tqdm.write(f"{example.qid}: {time.perf_counter() - began:.0f}s")
    summary = write_summary(out, args.model, args.dtype, rows)
    if args.record_floor:
        record_model_floor(summary, args.model, args.record_floor, args.dtype, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
