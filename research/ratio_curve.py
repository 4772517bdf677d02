"""Study, in process (no server): answer quality against the recompute ratio, r up to 0.9.

Usage: `python -m research.ratio_curve [--questions N] [--resume]`
-> `research/results/fusion_ratio_curve.json` (`--resume` measures the questions and modes the
file lacks).

Same prompts as `benchmarks/fusion_quality.py` (HotpotQA, 6 shuffled documents as chunks, greedy
answers of up to 16 tokens, stopped at <|im_end|> like the server). Per mode and question:

- MiniLM similarity of the answer to the full prefill's answer (the issue's metric) and exact
  agreement;
- first-token KL divergence to the full prefill;
- teacher-forced KL: the mean per-token KL to the full prefill while both decode the *full
  prefill's* answer, so one early flip does not compound into a different continuation.

`gap_closed` = (x - x_reuse) / (x_full - x_reuse) for each metric (x_full = 1 for similarity, 0 for
the divergences). The point: how much of the answer-level gap any selector can close on SmolLM2,
and whether a metric that does not compound flips ranks the selectors the same way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.smollm2_in_process import load_smollm2, question_segments
from benchmarks.smollm2_server import MODEL
from sglang_hicache_ext.evaluation.answer_quality import embedding_similarity
from sglang_hicache_ext.evaluation.hotpotqa import load_hotpotqa
from sglang_hicache_ext.fusion import make_selector
from sglang_hicache_ext.fusion.adapter import ModelAdapter
from sglang_hicache_ext.fusion.decoding import decode_step
from sglang_hicache_ext.fusion.executor import KVCache, fused_prefill
from sglang_hicache_ext.fusion.request import Segment
from sglang_hicache_ext.fusion.selectors import Selector

RESULTS = Path(__file__).resolve().parent / "results"
ANSWER_TOKENS = 16
RATIOS = (0.15, 0.3, 0.5, 0.7, 0.9)
# mode -> (selector, ratio, sink_tokens)
MODES: dict[str, tuple[str, float, int]] = {
    "reuse": ("reuse", 0.0, 0),
    "random@0.15": ("random", 0.15, 0),
    "epic@0.15": ("epic", 0.15, 0),
    **{f"{name}@{r}": (name, r, 0) for name in ("a3", "cacheblend") for r in RATIOS},
    "a3+sink4@0.15": ("a3", 0.15, 4),
    "a3+sink16@0.15": ("a3", 0.15, 16),
}
OUT = RESULTS / "fusion_ratio_curve.json"


def _kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    ref, log_p = reference.log_softmax(-1), logits.log_softmax(-1)
    return float((ref.exp() * (ref - log_p)).sum())


def _decode(
    adapter: ModelAdapter, kv: KVCache, first: int, forced: Sequence[int] | None, stop: set[int]
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decode from `first` (or feed `forced` tokens); the logits after each fed token."""
    tokens, logits_seen = [first], []
    token = first
    while len(tokens) < ANSWER_TOKENS and token not in stop:
        logits, kv = decode_step(adapter, kv, token)
        logits_seen.append(logits)
        if forced is not None:
            if len(tokens) >= len(forced):
                break
            token = forced[len(tokens)]
        else:
            token = int(logits.argmax())
        tokens.append(token)
    return tokens, logits_seen


def _run(
    adapter: ModelAdapter,
    segments: Sequence[Segment],
    selector: Selector,
    stop: set[int],
    forced: Sequence[int] | None,
) -> tuple[list[int], torch.Tensor, list[torch.Tensor]]:
    """(greedy answer, first-token logits, logits along `forced`'s tokens).

    Without `forced`, the logits along the greedy answer itself (what forcing it would give).
    """
    prefill = fused_prefill(adapter, segments, selector, return_kv=True)
    assert prefill.kv is not None
    answer, teacher = _decode(adapter, prefill.kv, int(prefill.logits.argmax()), None, stop)
    if forced is not None:
        _, teacher = _decode(adapter, prefill.kv, forced[0], forced, stop)
    return answer, prefill.logits, [prefill.logits, *teacher]


def _summarise(rows: list[dict]) -> dict[str, dict[str, float]]:
    full = [row["full"] for row in rows]
    summary: dict[str, dict[str, float]] = {}
    for mode in MODES:
        answers = [row["modes"][mode]["answer"] for row in rows]
        summary[mode] = {
            "similarity": statistics.mean(embedding_similarity(answers, full)),
            "exact": statistics.mean(a == f for a, f in zip(answers, full, strict=True)),
            "first_token_kl": statistics.mean(row["modes"][mode]["first_kl"] for row in rows),
            "teacher_forced_kl": statistics.mean(row["modes"][mode]["forced_kl"] for row in rows),
        }
    reuse = summary["reuse"]
    for values in summary.values():
        values["gap_closed_similarity"] = (values["similarity"] - reuse["similarity"]) / (
            1 - reuse["similarity"]
        )
        for metric in ("first_token_kl", "teacher_forced_kl"):
            values[f"gap_closed_{metric}"] = 1 - values[metric] / reuse[metric]
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    tokenizer, adapter = load_smollm2(threads=2)
    stop = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
    rows: list[dict] = json.loads(args.out.read_text())["rows"] if args.resume else []
    done = {row["qid"]: row for row in rows}
    started = time.perf_counter()
    examples = load_hotpotqa(args.questions, seed=2026)
    for index, example in enumerate(tqdm(examples, desc="questions", disable=None)):
        previous_row = done.get(example.qid)
        missing = [m for m in MODES if previous_row is None or m not in previous_row["modes"]]
        if not missing:
            continue
        segments = question_segments(example, tokenizer, adapter)
        full_answer, _, full_logits = _run(
            adapter, segments, make_selector("full", 1.0), stop, None
        )
        row: dict = previous_row or {
            "qid": example.qid,
            "full": tokenizer.decode(full_answer, skip_special_tokens=True).strip(),
            "modes": {},
        }
        if row["full"] != tokenizer.decode(full_answer, skip_special_tokens=True).strip():
            raise RuntimeError(f"{example.qid}: the full prefill's answer did not reproduce")
        for mode in missing:
            name, ratio, sinks = MODES[mode]
            answer, first, logits = _run(
                adapter, segments, make_selector(name, ratio, sink_tokens=sinks), stop, full_answer
            )
            row["modes"][mode] = {
                "answer": tokenizer.decode(answer, skip_special_tokens=True).strip(),
                "first_kl": _kl(full_logits[0], first),
                "forced_kl": statistics.mean(
                    _kl(ref, got) for ref, got in zip(full_logits, logits, strict=True)
                ),
            }
        if previous_row is None:
            rows.append(row)
        args.out.write_text(json.dumps({"model": MODEL, "rows": rows}, indent=1) + "\n")
        elapsed = time.perf_counter() - started
        tqdm.write(f"[{index + 1}/{args.questions}] {elapsed:.0f}s")
    summary = _summarise(rows)
    report = {"model": MODEL, "questions": len(rows), "summary": summary, "rows": rows}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'mode':<17}{'sim':>6}{'gap':>6}{'exact':>7}{'KL1':>7}{'gap':>6}{'KLtf':>7}{'gap':>6}")
    for mode, v in summary.items():
        print(
            f"{mode:<17}{v['similarity']:>6.3f}{v['gap_closed_similarity']:>6.2f}{v['exact']:>7.2f}"
            f"{v['first_token_kl']:>7.3f}{v['gap_closed_first_token_kl']:>6.2f}"
            f"{v['teacher_forced_kl']:>7.3f}{v['gap_closed_teacher_forced_kl']:>6.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
