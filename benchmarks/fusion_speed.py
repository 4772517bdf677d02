"""Fused vs normal prefill TTFT through the real CPU server, in one run.

SmolLM2-135M-Instruct (fp32, --radix-cache-backend hicache_ext, torch_position). Each prompt
holds >= `--min-docs` registered HotpotQA paragraphs (shuffled) and >= `--min-tokens` tokens,
plus a question. Per prompt, after /flush_cache: the normal prefill, then each fused selector;
TTFT = client latency of /generate with max_new_tokens=1. Medians over `--repeats` prompts;
JSON in benchmarks/results/fusion_speed.json.

    python -m benchmarks.fusion_speed [--repeats 5]
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import requests
from tqdm import tqdm

from benchmarks.smollm2_server import (
    MODEL,
    server_benchmark_parser,
    smollm2_server,
    smollm2_tokenizer,
    write_json,
)
from sglang_hicache_ext.evaluation.hotpotqa import load_hotpotqa
from sglang_hicache_ext.sglang_ext.frontend import register_documents
from sglang_hicache_ext.sglang_ext.server.launcher import flush_cache

MODES: dict[str, dict[str, object]] = {
    "normal": {},
    # The server's default selector (question_attention with 8 chunk-start sink tokens).
    "default_r0.15": {"fusion": True, "fusion_recompute_ratio": 0.15},
    # The previous default (question_error with 8 sink tokens).
    "question_error_r0.15": {
        "fusion": True,
        "fusion_selector": "question_error",
        "fusion_recompute_ratio": 0.15,
    },
    "a3_r0.15": {"fusion": True, "fusion_selector": "a3", "fusion_recompute_ratio": 0.15},
    "epic_r0.15": {"fusion": True, "fusion_selector": "epic", "fusion_recompute_ratio": 0.15},
    "reuse": {"fusion": True, "fusion_selector": "reuse", "fusion_recompute_ratio": 0.0},
}


def build_prompts(
    count: int, min_docs: int, min_tokens: int, tokenizer
) -> list[tuple[list[str], str]]:
    examples = load_hotpotqa(count * 6, seed=5)
    prompts = []
    for i in range(count):
        group = examples[i * 6 : (i + 1) * 6]
        docs: list[str] = []
        tokens = 0
        for doc in (d for ex in group for d in ex.documents):
            docs.append(doc)
            tokens += len(tokenizer.encode(doc, add_special_tokens=False))
            if len(docs) >= min_docs and tokens >= min_tokens:
                break
        random.Random(i).shuffle(docs)
        prompt = "Documents:\n" + "\n\n".join(docs) + f"\n\nQuestion: {group[0].question}\nAnswer:"
        prompts.append((docs, prompt))
    return prompts


def ttft(url: str, prompt: str, custom: dict[str, object]) -> tuple[float, dict]:
    body = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0, "custom_params": custom},
    }
    start = time.perf_counter()
    response = requests.post(url + "/generate", json=body, timeout=1200)
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    return elapsed, response.json()["meta_info"]


def main() -> int:
    parser = server_benchmark_parser(__doc__, "fusion_speed.json")
    parser.add_argument("--min-docs", type=int, default=6)
    parser.add_argument("--min-tokens", type=int, default=3000)
    args = parser.parse_args()

    prompts = build_prompts(args.repeats, args.min_docs, args.min_tokens, smollm2_tokenizer())
    runs: dict[str, list[float]] = {mode: [] for mode in MODES}
    details = []
    with smollm2_server("fusion-speed") as config:
        ttft(config.url, "Warm-up request.", {})
        for docs, prompt in tqdm(prompts, desc="prompts", unit="prompt", disable=None):
            register_documents(config.url, docs)
            row: dict[str, object] = {"documents": len(docs)}
            for mode, custom in MODES.items():
                flush_cache(config.url)
                seconds, meta = ttft(config.url, prompt, custom)
                runs[mode].append(seconds)
                row["prompt_tokens"] = meta["prompt_tokens"]
                row[mode] = {
                    "ttft_s": seconds,
                    "fusion": (meta.get("hicache_ext_fusion") or [None])[0],
                }
                if mode != "normal" and not row[mode]["fusion"]:
                    raise RuntimeError(f"{mode} did not fuse: {meta}")
            details.append(row)
            tqdm.write(
                f"{row['prompt_tokens']} tokens, {len(docs)} docs: "
                + "  ".join(f"{m} {row[m]['ttft_s']:.2f}s" for m in MODES)
            )
    medians = {mode: statistics.median(values) for mode, values in runs.items()}
    report = {
        "benchmark": "fusion_speed",
        "model": MODEL,
        "ttft_method": "client latency of /generate with max_new_tokens=1, after /flush_cache",
        "median_ttft_s": medians,
        "ratio_to_normal": {mode: medians[mode] / medians["normal"] for mode in MODES},
        "prompts": details,
    }
    write_json(args.out, report, indent=2)
    print(f"\n{'mode':<12}{'median TTFT':>13}{'x normal':>10}")
    for mode in MODES:
        print(f"{mode:<12}{medians[mode]:>12.2f}s{report['ratio_to_normal'][mode]:>10.3f}")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
