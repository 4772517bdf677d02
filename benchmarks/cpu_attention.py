"""torch_native vs torch_position on the real CPU server, in one run.

For each backend a fresh SGLang server (SmolLM2-135M-Instruct, fp32, --radix-cache-backend
hicache_ext) measures, over `--repeats` distinct ~6K-token prompts built from HotpotQA
paragraphs:
- full-prefill TTFT: after /flush_cache, a request with max_new_tokens=1 (client latency);
- prefix-cached TTFT: the same prompt again, now fully in the radix cache.
Then greedy outputs (16 tokens) of both backends are compared on `--agreement-prompts` prompts.
Medians are reported; the JSON lands in benchmarks/results/cpu_attention.json.

    python -m benchmarks.cpu_attention [--repeats 5]
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time

from tqdm import tqdm

from benchmarks.smollm2_server import (
    MODEL,
    server_benchmark_parser,
    smollm2_server,
    smollm2_tokenizer,
    write_json,
)
from sglang_hicache_ext.evaluation.hotpotqa import load_hotpotqa
from sglang_hicache_ext.sglang_ext.server.launcher import flush_cache, generate

BACKENDS = ("torch_native", "torch_position")


def long_prompts(count: int, target_tokens: int, tokenizer) -> list[str]:
    """Distinct prompts of about `target_tokens` tokens, from HotpotQA paragraphs."""
    examples = load_hotpotqa(400, seed=11)
    paragraphs = [doc for ex in examples for doc in ex.documents]
    prompts, cursor = [], 0
    for _ in range(count):
        parts, tokens = [], 0
        while tokens < target_tokens:
            paragraph = paragraphs[cursor]
            cursor += 1
            parts.append(paragraph)
            tokens += len(tokenizer.encode(paragraph, add_special_tokens=False))
        prompts.append("\n\n".join(parts) + "\n\nSummarise the documents above in one sentence:")
    return prompts


def agreement_prompts(count: int) -> list[str]:
    return [
        "\n\n".join(ex.documents[:4]) + f"\n\nQuestion: {ex.question}\nAnswer:"
        for ex in load_hotpotqa(count, seed=3)
    ]


def timed_generate(url: str, text: str, max_new_tokens: int) -> tuple[float, dict]:
    start = time.perf_counter()
    response = generate(url, text, max_new_tokens)
    return time.perf_counter() - start, response


def measure_backend(backend: str, prompts: list[str], agree: list[str]) -> dict:
    result: dict = {
        "backend": backend,
        "full_ttft_s": [],
        "cached_ttft_s": [],
        "prompt_tokens": [],
        "outputs": [],
    }
    with smollm2_server(f"cpu-attention-{backend}", attention_backend=backend) as config:
        timed_generate(config.url, "Warm-up request.", 1)
        for prompt in tqdm(prompts, desc=backend, unit="prompt", disable=None):
            flush_cache(config.url)
            full_s, full = timed_generate(config.url, prompt, 1)
            cached_s, cached = timed_generate(config.url, prompt, 1)
            meta = cached["meta_info"]
            if meta["cached_tokens"] < meta["prompt_tokens"] - 16:
                raise RuntimeError(f"{backend}: repeat was not prefix-cached: {meta}")
            result["full_ttft_s"].append(full_s)
            result["cached_ttft_s"].append(cached_s)
            result["prompt_tokens"].append(full["meta_info"]["prompt_tokens"])
            tqdm.write(
                f"  {backend}: {full['meta_info']['prompt_tokens']} tokens  full {full_s:.2f}s  cached {cached_s:.2f}s"
            )
        for prompt in agree:
            _, out = timed_generate(config.url, prompt, 16)
            result["outputs"].append(out["output_ids"])
    result["median_full_ttft_s"] = statistics.median(result["full_ttft_s"])
    result["median_cached_ttft_s"] = statistics.median(result["cached_ttft_s"])
    result["cached_over_full"] = result["median_cached_ttft_s"] / result["median_full_ttft_s"]
    return result


def main() -> int:
    parser = server_benchmark_parser(__doc__, "cpu_attention.json")
    parser.add_argument("--prompt-tokens", type=int, default=6000)
    parser.add_argument("--agreement-prompts", type=int, default=5)
    args = parser.parse_args()

    prompts = long_prompts(args.repeats, args.prompt_tokens, smollm2_tokenizer())
    agree = agreement_prompts(args.agreement_prompts)
    runs = {backend: measure_backend(backend, prompts, agree) for backend in BACKENDS}

    agreement = [
        a == b
        for a, b in zip(
            runs["torch_native"]["outputs"], runs["torch_position"]["outputs"], strict=True
        )
    ]
    report = {
        "benchmark": "cpu_attention",
        "model": MODEL,
        "dtype": "float32",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "repeats": args.repeats,
        "ttft_method": "client latency of /generate with max_new_tokens=1",
        "backends": {
            name: {k: v for k, v in run.items() if k != "outputs"} for name, run in runs.items()
        },
        "greedy_16_token_agreement": agreement,
        "position_cached_over_native_full": runs["torch_position"]["median_cached_ttft_s"]
        / runs["torch_native"]["median_full_ttft_s"],
    }
    write_json(args.out, report, indent=2)

    print(
        f"\n{'backend':<16}{'prompt tok':>11}{'full TTFT':>11}{'cached TTFT':>13}{'cached/full':>13}"
    )
    for name, run in runs.items():
        print(
            f"{name:<16}{statistics.median(run['prompt_tokens']):>11.0f}{run['median_full_ttft_s']:>10.2f}s"
            f"{run['median_cached_ttft_s']:>12.2f}s{run['cached_over_full']:>13.3f}"
        )
    print(
        f"greedy 16-token agreement on {len(agreement)} prompts: {sum(agreement)}/{len(agreement)}"
    )
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
