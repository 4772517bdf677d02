"""Fusion quality and TTFT per selector and recompute ratio, through the real CPU server.

HotpotQA questions; each question's paragraphs (supporting ones first, up to `--documents`) are
registered as chunks and shuffled in the prompt. Per question and mode, after /flush_cache, a
greedy answer of up to 16 tokens is streamed (TTFT = time to the first streamed chunk). Against
the normal (full) prefill's answer of the same prompt: exact agreement and MiniLM embedding
similarity; against the gold answer: HotpotQA F1; TTFT as a ratio to the normal prefill in the
same run (median over questions). `gap_closed` = (sim - sim_reuse) / (1 - sim_reuse), where the
normal prefill's similarity to itself is 1. Results: benchmarks/results/fusion_quality.json
(rewritten after every question, so an interrupted run keeps what it measured).

    python -m benchmarks.fusion_quality [--questions 100] [--resume]
"""

from __future__ import annotations

import json
import random
import statistics
import sys

from tqdm import tqdm

from benchmarks.smollm2_server import MODEL, server_benchmark_parser, smollm2_server, write_json
from sglang_hicache_ext.evaluation.answer_quality import embedding_similarity, f1_score
from sglang_hicache_ext.evaluation.hotpotqa import load_hotpotqa
from sglang_hicache_ext.sglang_ext.frontend import register_documents
from sglang_hicache_ext.sglang_ext.server.launcher import flush_cache
from sglang_hicache_ext.sglang_ext.tools.streaming_client import stream_generate

SELECTORS = ("a3", "freq", "cacheblend", "epic", "random")
RATIOS = (0.05, 0.15, 0.3)
# A3 with the first tokens of each chunk put first in its budget (`fusion_sink_tokens`).
SINK_VARIANTS = ((4, 0.15), (16, 0.15))
SYSTEM = "Answer the question using the documents. Reply with a short phrase."


def modes() -> dict[str, dict[str, object]]:
    table: dict[str, dict[str, object]] = {
        "normal": {},
        "reuse": {"fusion": True, "fusion_selector": "reuse", "fusion_recompute_ratio": 0.0},
    }
    for selector in SELECTORS:
        for ratio in RATIOS:
            table[f"{selector}@{ratio}"] = {
                "fusion": True,
                "fusion_selector": selector,
                "fusion_recompute_ratio": ratio,
            }
    for sinks, ratio in SINK_VARIANTS:
        table[f"a3+sink{sinks}@{ratio}"] = {
            "fusion": True,
            "fusion_selector": "a3",
            "fusion_recompute_ratio": ratio,
            "fusion_sink_tokens": sinks,
        }
    return table


def chat_prefix() -> str:
    """What every prompt starts with: the system prompt and the user turn's header."""
    return f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"


def chatml_prompt(documents: list[str], question: str) -> str:
    body = "\n\n".join(f"Document {i + 1}. {d}" for i, d in enumerate(documents))
    return f"{chat_prefix()}{body}\n\nQuestion: {question}<|im_end|>\n<|im_start|>assistant\n"


def stream_answer(
    url: str, prompt: str, custom: dict[str, object], max_tokens: int
) -> tuple[str, float, dict]:
    body = {
        "text": prompt,
        "sampling_params": {
            "max_new_tokens": max_tokens,
            "temperature": 0,
            "custom_params": custom,
            "stop": ["<|im_end|>"],
        },
    }
    answer = stream_generate(url, body, timeout=1200)
    return answer.text.strip(), answer.ttft_s, answer.meta


def summarise(rows: list[dict], table: dict[str, dict[str, object]]) -> dict[str, dict[str, float]]:
    normal = [r["normal"]["answer"] for r in rows]
    summary: dict[str, dict[str, float]] = {}
    for mode in table:
        answers = [r[mode]["answer"] for r in rows]
        sims = embedding_similarity(answers, normal)
        summary[mode] = {
            "exact_agreement": statistics.mean(
                a == b for a, b in zip(answers, normal, strict=True)
            ),
            "embedding_similarity": statistics.mean(sims),
            "f1_gold": statistics.mean(
                f1_score(a, r["gold"]) for a, r in zip(answers, rows, strict=True)
            ),
            # A mode added on --resume is timed against the normal prefill of its own run.
            "ttft_ratio_median": statistics.median(
                r[mode]["ttft_s"] / r[mode].get("normal_ttft_s", r["normal"]["ttft_s"])
                for r in rows
            ),
        }
    reuse_sim = summary["reuse"]["embedding_similarity"]
    for values in summary.values():
        gap = 1.0 - reuse_sim
        values["gap_closed"] = (
            (values["embedding_similarity"] - reuse_sim) / gap if gap > 0 else 1.0
        )
    return summary


def _report(
    rows: list[dict], table: dict[str, dict[str, object]], documents: int, summary: bool
) -> dict:
    report: dict = {
        "benchmark": "fusion_quality",
        "model": MODEL,
        "questions": len(rows),
        "documents_per_prompt": documents,
    }
    if summary:
        report["summary"] = summarise(rows, table)
    return {**report, "rows": rows}


def main() -> int:
    parser = server_benchmark_parser(__doc__, "fusion_quality.json")
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--documents", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep what --out holds; measure the questions and modes it lacks (modes added "
        "since: the normal answer is measured again and must reproduce)",
    )
    args = parser.parse_args()

    table = modes()
    rows: list[dict] = []
    mismatches = 0
    if args.resume and args.out.exists():
        previous = json.loads(args.out.read_text())
        if previous.get("documents_per_prompt") != args.documents:
            raise SystemExit(f"{args.out}: measured with other --documents; cannot resume")
        rows = previous["rows"]
        mismatches = previous.get("normal_answers_not_reproduced_on_resume", 0)
        print(f"resuming: {len(rows)} questions already measured", flush=True)
    done = {row["qid"]: row for row in rows}
    normal_ttft_s = 0.0
    report: dict = {}
    with smollm2_server("fusion-quality") as config:
        examples = load_hotpotqa(args.questions, seed=2026)
        for index, example in enumerate(tqdm(examples, desc="questions", disable=None)):
            previous_row = done.get(example.qid)
            missing = [m for m in table if previous_row is None or m not in previous_row]
            if not missing:
                continue
            documents = example.context(args.documents)
            register_documents(config.url, documents)
            shuffled = random.Random(example.qid).sample(documents, len(documents))
            prompt = chatml_prompt(shuffled, example.question)
            row: dict = previous_row or {"qid": example.qid, "gold": example.answer}
            # Modes added to a measured question are compared with its stored normal answer, so
            # that answer must reproduce (the server is deterministic for one request at a time).
            to_measure = missing if previous_row is None else ["normal", *missing]
            for mode in to_measure:
                flush_cache(config.url)
                answer, ttft_s, meta = stream_answer(
                    config.url, prompt, table[mode], args.max_tokens
                )
                fusion = (meta.get("hicache_ext_fusion") or [None])[0]
                if mode != "normal" and not (fusion and fusion["fused"]):
                    raise RuntimeError(f"question {example.qid}, {mode}: not fused ({meta})")
                if mode == "normal" and previous_row is not None:
                    mismatches += answer != row["normal"]["answer"]
                    normal_ttft_s = ttft_s
                    continue
                row[mode] = {"answer": answer, "ttft_s": ttft_s}
                if previous_row is not None:
                    row[mode]["normal_ttft_s"] = normal_ttft_s
                row["prompt_tokens"] = meta["prompt_tokens"]
            if previous_row is None:
                rows.append(row)
            # Embedding every answer again is O(questions^2): summarise every 10 questions and at
            # the end; the rows are written after every question.
            last = index + 1 == args.questions
            complete = all(mode in r for r in rows for mode in table)
            report = _report(
                rows, table, args.documents, summary=complete and (last or len(rows) % 10 == 0)
            )
            report["normal_answers_not_reproduced_on_resume"] = mismatches
            write_json(args.out, report, indent=2)
            tqdm.write(
                f"[{index + 1}/{args.questions}] {row['prompt_tokens']} tokens"
                + (f", normal answers not reproduced so far: {mismatches}" if done else "")
            )
    if report and "summary" not in report:
        report = _report(rows, table, args.documents, summary=True)
        report["normal_answers_not_reproduced_on_resume"] = mismatches
        write_json(args.out, report, indent=2)
    if not report:
        print("nothing left to measure")
        return 0
    summary = report["summary"]
    print(f"\n{'mode':<16}{'exact':>7}{'emb sim':>9}{'gap closed':>12}{'F1 gold':>9}{'TTFT x':>8}")
    for mode, values in summary.items():
        print(
            f"{mode:<16}{values['exact_agreement']:>7.2f}{values['embedding_similarity']:>9.3f}"
            f"{values['gap_closed']:>12.2f}{values['f1_gold']:>9.3f}{values['ttft_ratio_median']:>8.2f}"
        )
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
