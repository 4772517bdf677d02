"""Does fusion keep the model's answers? F1 retention and fidelity per selector and ratio.

In process (the fusion executor over transformers' modules; the server reproduces the executor's
answers exactly, docs/fusion-sglang.md), HotpotQA distractor questions, every paragraph of a
question registered as a chunk and the paragraphs shuffled in the prompt (ChatML, the same prompt
as benchmarks/fusion_quality.py). Per question, every method on the same prompt:

- the greedy answer (stopped at <|im_end|>, at most 16 tokens): token F1 against the gold answer,
  and agreement with the full prefill's answer (equal after HotpotQA normalisation);
- the teacher-forced KL to the full prefill along the full prefill's answer, and the first-token KL;
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
A method is `full`, `reuse`, or `<selector>[+sink<N>]@<ratio>`; `default` is the server's default
selector; `<method>#<codec>` (e.g. `default@0.15#int8`) runs it on chunks stored through a codec
(`tiers/codecs`: int8, int4); `<method>:keep<C>` (e.g. `default@0.15:keep0.25`) decodes with
only C of the prompt's tokens kept per layer and head after the prefill (decode-time eviction,
`fusion/decode_eviction.py`). `--min-prompt-tokens N` pads every prompt with paragraphs of the
other sampled questions (also chunks) until it has N tokens. `--resume` adds missing questions
and methods to an earlier file (the full prefill's answer must reproduce exactly).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.stats import bootstrap
from tqdm import tqdm

from benchmarks.fusion_quality import chatml_prompt
from benchmarks.retention_methods import (
    DEFAULT_SELECTOR,
    DEFAULT_SINK_TOKENS,
    parse_method,
    split_codec,
    split_keep,
)
from benchmarks.smollm2_server import RESULTS
from sglang_hicache_ext.evaluation.answer_quality import f1_score, normalize_answer
from sglang_hicache_ext.evaluation.fused_answers import (
    MethodRun,
    kl_divergence,
    run_method,
    teacher_forced_kl,
)
from sglang_hicache_ext.evaluation.hotpotqa import HotpotQAExample, load_hotpotqa
from sglang_hicache_ext.evaluation.model_paths import QWEN_CODER, SMOLLM2, prepared_model
from sglang_hicache_ext.fusion import make_selector, precompute_chunk
from sglang_hicache_ext.fusion.adapter import ModelAdapter
from sglang_hicache_ext.fusion.adapters.hf import HFCausalLMAdapter
from sglang_hicache_ext.fusion.chunk import PrecomputedChunk
from sglang_hicache_ext.fusion.request import Segment, build_layout
from sglang_hicache_ext.sglang_ext.chunk_fusion.plan import pinned_chunk_segments
from sglang_hicache_ext.sglang_ext.chunk_fusion.registry import ChunkRegistry
from sglang_hicache_ext.tiers.chunk_forms import stored_codec
from sglang_hicache_ext.tiers.chunk_forms import through_codec as stored_through_codec
from sglang_hicache_ext.tuning.ratio.quality_floor import (
    FLOORS_FILE,
    TARGET_RETENTION,
    CurvePoint,
    QualityFloor,
    floor_from_curve,
    record_floor,
)

MODELS = {"qwen": QWEN_CODER, "smollm2": SMOLLM2}
PREPARE = {"qwen": "make models-qwen", "smollm2": "make models"}
ANSWER_TOKENS = 16
SEED = 2026  # question sample: the same questions for every model and method
ANSWERED_F1 = 0.5  # a question counts as answered from this token F1 on
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


def question_segments(
    example: HotpotQAExample, tokenizer: Any, adapter: ModelAdapter, codec: str | None = None
) -> list[Segment]:
    """The prompt with every paragraph shuffled in, each matched to its precomputed chunk the way
    the server matches them (the whole prompt tokenized, chunks found by the chunk index); with
    `codec`, every chunk's K/V went through it (compressed and decompressed) first."""
    paragraphs = list(example.documents)
    shuffled = random.Random(example.qid).sample(paragraphs, len(paragraphs))
    ids = tokenizer.encode(chatml_prompt(shuffled, example.question), add_special_tokens=False)
    registry = ChunkRegistry(2**34, adapter.rope_spec)
    for paragraph in paragraphs:
        tokens = tokenizer.encode(paragraph, add_special_tokens=False)
        chunk = precompute_chunk(adapter, tokens)
        registry.add(chunk if codec is None else through_codec(chunk, codec))
    return pinned_chunk_segments(registry, ids)[0]


def through_codec(chunk: PrecomputedChunk, spec: str) -> PrecomputedChunk:
    """The chunk as a tier storing it with codec `spec` returns it (int8 / int4: the codecs
    tiers store, `tiers/chunk_forms.py`)."""
    try:
        return PrecomputedChunk(*stored_through_codec(chunk, stored_codec(spec)))
    except ValueError as err:
        raise SystemExit(str(err)) from None


def measure(
    full: MethodRun, run: MethodRun, tokenizer: Any, gold: str, full_text: str
) -> dict[str, Any]:
    text = tokenizer.decode(run.answer, skip_special_tokens=True).strip()
    return {
        "answer": text,
        "f1": f1_score(text, gold),
        "agree": normalize_answer(text) == normalize_answer(full_text),
        "kl": teacher_forced_kl(full, run),
        "first_kl": kl_divergence(full.first_logits, run.first_logits),
        "prefill_s": run.prefill_s,
    }


def _interval(samples: tuple[np.ndarray, ...], statistic: Any) -> list[float]:
    identical = len(samples) > 1 and all(np.array_equal(samples[0], o) for o in samples[1:])
    if len(samples[0]) < 3 or identical or np.ptp(np.concatenate(samples)) == 0:
        value = float(statistic(*samples))
        return [value, value]
    # BCa needs a non-degenerate jackknife; many equal F1 values (0 or 1) can defeat it, and
    # then the percentile interval is the honest fallback.
    for method in ("BCa", "percentile"):
        result = bootstrap(
            samples,
            statistic,
            paired=True,
            vectorized=False,
            n_resamples=2000,
            confidence_level=0.95,
            method=method,
            random_state=0,
        )
        if not np.isnan(result.confidence_interval.low):
            break
    return [float(result.confidence_interval.low), float(result.confidence_interval.high)]


def summarise(rows: list[dict[str, Any]], methods: list[str]) -> dict[str, dict[str, Any]]:
    """Per method over the questions that have it (and reuse, for the paired KL gap): a ratio
    curve may cover fewer questions than the methods compared at one ratio."""
    summary: dict[str, dict[str, Any]] = {
        "full": {
            "questions": len(rows),
            "f1": float(np.mean([row["f1_full"] for row in rows])),
            "retention": 1.0,
            "agree": 1.0,
        }
    }
    for method in methods:
        have = [row for row in rows if method in row["methods"] and "reuse" in row["methods"]]
        runs = [row["methods"][method] for row in have]
        f1_full = np.array([row["f1_full"] for row in have])
        f1 = np.array([run["f1"] for run in runs])
        kl = np.array([run["kl"] for run in runs])
        kl_reuse = np.array([row["methods"]["reuse"]["kl"] for row in have])
        summary[method] = {
            "questions": len(have),
            "f1_full": float(f1_full.mean()),
            "f1": float(f1.mean()),
            "retention": float(f1.mean() / f1_full.mean()),
            "retention_ci95": _interval((f1, f1_full), lambda a, b: a.mean() / b.mean()),
            "agree": statistics.mean(run["agree"] for run in runs),
            "kl": float(kl.mean()),
            "first_kl": statistics.mean(run["first_kl"] for run in runs),
            "prefill_ratio": statistics.median(
                run["prefill_s"] / row["full_prefill_s"]
                for run, row in zip(runs, have, strict=True)
            ),
            "kl_gap_closed": float(1 - kl.mean() / kl_reuse.mean()),
            "kl_gap_closed_ci95": _interval((kl, kl_reuse), lambda a, b: 1 - a.mean() / b.mean()),
            **_answers_kept(f1_full, f1),
        }
    return summary


def _answers_kept(f1_full: np.ndarray, f1: np.ndarray) -> dict[str, Any]:
    answered = f1_full >= ANSWERED_F1
    kept = (f1[answered] >= ANSWERED_F1).astype(float)
    return {
        "answered_by_full": int(answered.sum()),
        "kept": float(kept.mean()) if len(kept) else float("nan"),
        "kept_ci95": _interval((kept,), np.mean) if len(kept) else [float("nan")] * 2,
        "gained": int((f1[~answered] >= ANSWERED_F1).sum()),
    }


def ratio_curve(summary: dict[str, dict[str, Any]], selector: str) -> tuple[CurvePoint, ...]:
    """F1 retention of `selector` (e.g. "a3+sink4") at every ratio the summary measured."""
    curve = []
    for method, values in summary.items():
        name, _, ratio = method.partition("@")
        if name == selector and ratio.replace(".", "", 1).isdigit():  # no codec, no eviction
            low, high = values["retention_ci95"]
            curve.append(
                CurvePoint(float(ratio), values["retention"], (low, high), values["questions"])
            )
    return tuple(sorted(curve))


def print_table(summary: dict[str, dict[str, Any]]) -> None:
    """The summary as the markdown table the docs show."""
    print(
        "| method | questions | F1 | F1 retention [95 % CI] | answers kept [95 % CI] | gained "
        "| agrees with full | teacher-forced KL | KL gap closed [95 % CI] | prefill time ÷ full |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for method, v in summary.items():
        ci = v.get("retention_ci95", [1.0, 1.0])
        retention = f"{v['retention']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"
        gap = ""
        if "kl_gap_closed" in v:
            low, high = v["kl_gap_closed_ci95"]
            gap = f"{v['kl_gap_closed']:.2f} [{low:.2f}, {high:.2f}]"
        kl = f"{v['kl']:.4f}" if "kl" in v else "0"
        kept = "1.00" if "kept" not in v else f"{v['kept']:.2f} [{v['kept_ci95'][0]:.2f}, "
        kept += "" if "kept" not in v else f"{v['kept_ci95'][1]:.2f}] of {v['answered_by_full']}"
        gained = str(v.get("gained", 0))
        time_ratio = f"{v.get('prefill_ratio', 1.0):.2f}"
        print(
            f"| `{method}` | {v['questions']} | {v['f1']:.3f} | {retention} | {kept} | {gained} "
            f"| {v['agree']:.2f} "
            f"| {kl} | {gap} | {time_ratio} |"
        )


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
    selectors = {m: parse_method(split_codec(m)[0]) for m in methods}
    codecs = sorted({c for m in methods if (c := split_codec(m)[1]) is not None})
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
    stop = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
    earlier = json.loads(out.read_text()) if args.resume and out.exists() else {"rows": []}
    if earlier.get("dtype", args.dtype) != args.dtype:
        raise SystemExit(f"{out} was measured in {earlier['dtype']}, not {args.dtype}")
    rows: list[dict[str, Any]] = earlier["rows"]
    by_qid = {row["qid"]: row for row in rows}
    examples = load_hotpotqa(args.questions, seed=args.seed)
    for example in tqdm(examples, desc=args.model, disable=None):
        example = padded(example, examples, tokenizer, args.min_prompt_tokens)
        row = by_qid.get(example.qid)
        missing = [m for m in methods if row is None or m not in row["methods"]]
        if not missing:
            continue
        began = time.perf_counter()
        segments = question_segments(example, tokenizer, adapter)
        full = run_method(adapter, segments, make_selector("full", 1.0), stop, ANSWER_TOKENS)
        full_text = tokenizer.decode(full.answer, skip_special_tokens=True).strip()
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
        elif row["full"] != full_text:
            raise RuntimeError(f"{example.qid}: the full prefill's answer did not reproduce")
        row["full_prefill_s"] = full.prefill_s
        coded = {codec: question_segments(example, tokenizer, adapter, codec) for codec in codecs}
        for method in missing:
            codec = split_codec(method)[1]
            on = segments if codec is None else coded[codec]
            keep = split_keep(method)[1]
            run = run_method(
                adapter, on, selectors[method], stop, ANSWER_TOKENS, full.answer, keep
            )
            row["methods"][method] = measure(full, run, tokenizer, example.answer, full_text)
        partial = {"model": MODELS[args.model], "dtype": args.dtype, "rows": rows}
        out.write_text(json.dumps(partial, indent=1) + "\n")
        tqdm.write(f"{example.qid}: {time.perf_counter() - began:.0f}s")
    summary = write_summary(out, args.model, args.dtype, rows)
    if args.record_floor:
        record_model_floor(summary, args.model, args.record_floor, args.dtype, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
