"""Every request shape fused, through the real CPU server: prompts split across chunked-prefill
rounds, logprobs, and concurrent fused requests computed together.

SmolLM2-135M-Instruct (fp32, CPU). One JSON, benchmarks/results/fusion_request_shapes.json:

1. split: a >= 12K-token RAG prompt (registered HotpotQA paragraphs) on a server with
   `--chunked-prefill-size 2048` (context raised to 16384): fused at r = 1 (`full`) must give the
   normal prefill's output ids with no fallback counted, and report its fused rounds; TTFTs of
   normal, full and a3 at r = 0.15 beside it (each after /flush_cache).
2. logprobs, same server: input logprobs from token 1000 on and output logprobs (top-5 too),
   fused at r = 1 vs the normal prefill; the noise floor is the normal prefill against itself with
   its first 1000 tokens cached (another kernel split of the same fp32 computation).
3. concurrency, a second server (one prefill round holds all 8): 8 fused requests (a3, r = 0.15,
   ~1K tokens) sent at once vs one after another, median of --repeats, same run; outputs must be
   equal. With max_new_tokens 1 (prefill only) and 16. In process beside it: the executor's
   `fused_prefill_batch` of the 8 against 8 `fused_prefill` calls (no decode, no server).

    python -m benchmarks.fusion_request_shapes [--repeats 3] [--min-tokens 12000] [--threads 1]

`--threads N` runs the servers and the in-process part on N torch threads (OMP_NUM_THREADS);
on a machine shared with other CPU-bound work, 1 thread avoids OpenMP barrier stalls that make
timings erratic (the JSON records the value).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests

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

FULL = {"fusion": True, "fusion_selector": "full", "fusion_recompute_ratio": 1.0}
A3 = {"fusion": True, "fusion_selector": "a3", "fusion_recompute_ratio": 0.15}
LOGPROB_START = 1000


def post(url: str, text: str, custom: dict[str, Any], new_tokens: int = 16, **extra: Any) -> dict:
    """/generate, greedy; the response with the client latency as `seconds`."""
    body = {
        "text": text,
        "sampling_params": {
            "max_new_tokens": new_tokens,
            "temperature": 0,
            "custom_params": custom,
        },
        **extra,
    }
    began = time.perf_counter()
    response = requests.post(url + "/generate", json=body, timeout=3600)
    response.raise_for_status()
    return {**response.json(), "seconds": time.perf_counter() - began}


def fusion_stats(url: str) -> dict[str, int]:
    info = requests.get(url + "/server_info", timeout=60).json()["internal_states"][0]
    return info["hicache_ext"]["fusion"]


def rag_prompt(tokenizer: Any, min_tokens: int, seed: int) -> tuple[list[str], str]:
    """Whole HotpotQA paragraphs until the prompt reaches `min_tokens`, then one question."""
    docs: list[str] = []
    examples = load_hotpotqa(max(4, min_tokens // 800), seed=seed)
    total = 0
    for doc in (d for example in examples for d in example.documents):
        docs.append(doc)
        total += len(tokenizer.encode(doc, add_special_tokens=False)) + 2
        if total >= min_tokens:
            break
    prompt = "Documents:\n" + "\n\n".join(docs) + f"\n\nQuestion: {examples[0].question}\nAnswer:"
    return docs, prompt


def measure_split(url: str, prompt: str, tokens: int) -> dict[str, Any]:
    flush_cache(url)
    before = fusion_stats(url)
    full = post(url, prompt, FULL)
    after = fusion_stats(url)
    fallbacks = {
        k: after[k] - before.get(k, 0)
        for k in after
        if k.startswith("fallback_") and after[k] != before.get(k, 0)
    }
    flush_cache(url)
    normal = post(url, prompt, {})
    flush_cache(url)
    a3 = post(url, prompt, A3)
    row = {
        "prompt_tokens": tokens,
        "fused_report": full["meta_info"]["hicache_ext_fusion"][0],
        "a3_report": a3["meta_info"]["hicache_ext_fusion"][0],
        "fallbacks_counted": fallbacks,
        "output_ids_equal_at_r1": full["output_ids"] == normal["output_ids"],
        "ttft_like_latency_s": {  # 16 new tokens each
            "normal": normal["seconds"],
            "full_r1": full["seconds"],
            "a3_r0.15": a3["seconds"],
        },
    }
    print(
        f"split: {tokens} tokens, fused={row['fused_report']['fused']} in "
        f"{row['fused_report'].get('prefill_rounds')} rounds, fallbacks {fallbacks or 'none'}, "
        f"r=1 ids equal {row['output_ids_equal_at_r1']}; latency normal {normal['seconds']:.1f}s, "
        f"full {full['seconds']:.1f}s, a3 {a3['seconds']:.1f}s"
    )
    return row


def logprob_gap(a: dict, b: dict) -> float:
    """Largest |difference| of input/output logprobs and top-5 logprobs (same token ids)."""
    gaps = [0.0]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        pairs = zip(a["meta_info"][key], b["meta_info"][key], strict=True)
        gaps += [abs(x[0] - y[0]) for x, y in pairs if x[0] is not None and x[1] == y[1]]
    for key in ("input_top_logprobs", "output_top_logprobs"):
        for xs, ys in zip(a["meta_info"][key], b["meta_info"][key], strict=True):
            gaps += [abs(x[0] - y[0]) for x, y in zip(xs or [], ys or [], strict=True)]
    return max(gaps)


def measure_logprobs(url: str, tokenizer: Any, prompt: str) -> dict[str, Any]:
    ids = tokenizer.encode(prompt, add_special_tokens=False)[:3000]
    text = tokenizer.decode(ids)
    extra = {"return_logprob": True, "logprob_start_len": LOGPROB_START, "top_logprobs_num": 5}
    flush_cache(url)
    fused = post(url, text, FULL, 8, **extra)
    flush_cache(url)
    normal = post(url, text, {}, 8, **extra)
    post(url, tokenizer.decode(ids[:LOGPROB_START]), {}, 1)  # cache the first 1000 tokens
    cached = post(url, text, {}, 8, **extra)
    row = {
        "prompt_tokens": len(ids),
        "logprob_start_len": LOGPROB_START,
        "fused_report": fused["meta_info"]["hicache_ext_fusion"][0],
        "output_ids_equal": fused["output_ids"] == normal["output_ids"],
        "input_logprobs": len(fused["meta_info"]["input_token_logprobs"]),
        "max_abs_diff_fused_vs_normal": logprob_gap(fused, normal),
        "noise_floor_normal_vs_normal_prefix_cached": logprob_gap(cached, normal),
        "normal_cached_tokens": cached["meta_info"]["cached_tokens"],
    }
    print(
        f"logprobs: {row['input_logprobs']} input + 8 output, fused={row['fused_report']['fused']}: "
        f"max |fused - normal| {row['max_abs_diff_fused_vs_normal']:.2e}, noise floor "
        f"{row['noise_floor_normal_vs_normal_prefix_cached']:.2e}"
    )
    return row


def measure_concurrency(url: str, prompts: list[str], repeats: int) -> dict[str, Any]:
    post(url, prompts[0], A3, 1)  # warm-up
    rows: dict[str, Any] = {}
    for new_tokens in (1, 16):
        serial_s, together_s, equal = [], [], True
        for _ in range(repeats):
            began = time.perf_counter()
            serial = [post(url, p, A3, new_tokens)["output_ids"] for p in prompts]
            serial_s.append(time.perf_counter() - began)
            began = time.perf_counter()
            with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
                sent = [pool.submit(post, url, p, A3, new_tokens) for p in prompts]
                together = [future.result()["output_ids"] for future in sent]
            together_s.append(time.perf_counter() - began)
            equal = equal and together == serial
        row = {
            "serial_s": serial_s,
            "concurrent_s": together_s,
            "median_serial_s": statistics.median(serial_s),
            "median_concurrent_s": statistics.median(together_s),
            "outputs_equal": equal,
        }
        row["throughput_speedup"] = row["median_serial_s"] / row["median_concurrent_s"]
        rows[f"max_new_tokens_{new_tokens}"] = row
        print(
            f"concurrency, {len(prompts)} fused requests, {new_tokens} new tokens: serial "
            f"{row['median_serial_s']:.2f}s, at once {row['median_concurrent_s']:.2f}s "
            f"({row['throughput_speedup']:.2f}x), outputs equal {equal}"
        )
    stats = fusion_stats(url)
    rows["largest_fused_batch"] = stats.get("largest_fused_batch", 0)
    return rows


def measure_in_process(repeats: int, count: int, threads: int) -> dict[str, Any]:
    """The executor alone: one batched prefill of `count` requests vs `count` single ones."""
    from benchmarks.smollm2_in_process import load_smollm2, question_segments
    from sglang_hicache_ext.fusion.executor import FusionJob, fused_prefill, fused_prefill_batch
    from sglang_hicache_ext.fusion.selectors import make_selector

    tokenizer, adapter = load_smollm2(threads=threads)
    requests_ = [question_segments(e, tokenizer, adapter) for e in load_hotpotqa(count, seed=3)]
    jobs = [FusionJob(segments, make_selector("a3", 0.15)) for segments in requests_]
    fused_prefill_batch(adapter, jobs[:2])  # warm-up
    serial_s, batch_s = [], []
    for _ in range(repeats):
        began = time.perf_counter()
        alone = [fused_prefill(adapter, job.segments, job.selector).logits for job in jobs]
        serial_s.append(time.perf_counter() - began)
        began = time.perf_counter()
        together = [result.logits for result in fused_prefill_batch(adapter, jobs)]
        batch_s.append(time.perf_counter() - began)
    gap = max(float((a - b).abs().max()) for a, b in zip(alone, together, strict=True))
    row = {
        "requests": count,
        "median_serial_s": statistics.median(serial_s),
        "median_batched_s": statistics.median(batch_s),
        "max_abs_logit_diff": gap,
        "argmax_equal": all(
            int(a.argmax()) == int(b.argmax()) for a, b in zip(alone, together, strict=True)
        ),
    }
    row["speedup"] = row["median_serial_s"] / row["median_batched_s"]
    print(
        f"in process: {count} prefills one by one {row['median_serial_s']:.2f}s, batched "
        f"{row['median_batched_s']:.2f}s ({row['speedup']:.2f}x), max logit diff {gap:.1e}"
    )
    return row


def main() -> int:
    parser = server_benchmark_parser(__doc__, "fusion_request_shapes.json")
    parser.set_defaults(repeats=3)
    parser.add_argument("--min-tokens", type=int, default=12000)
    parser.add_argument("--concurrent", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=["split", "concurrency", "in_process"]
    )
    args = parser.parse_args()
    tokenizer = smollm2_tokenizer()
    report: dict[str, Any] = {
        "benchmark": "fusion_request_shapes",
        "model": MODEL,
        "torch_threads": args.threads or os.cpu_count(),
    }
    threads_env = {} if args.threads is None else {"OMP_NUM_THREADS": str(args.threads)}
    if "split" not in args.skip:
        docs, prompt = rag_prompt(tokenizer, args.min_tokens, seed=13)
        tokens = len(tokenizer.encode(prompt))
        settings = {
            "max_total_tokens": 40_000,
            "extra_args": ("--chunked-prefill-size", "2048", "--context-length", "16384"),
            "env": {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1", **threads_env},
        }
        with smollm2_server("request-shapes", **settings) as config:
            register_documents(config.url, docs)
            report["split"] = measure_split(config.url, prompt, tokens)
            report["logprobs"] = measure_logprobs(config.url, tokenizer, prompt)
    if "concurrency" not in args.skip:
        prompts = []
        all_docs = []
        for i in range(args.concurrent):
            docs, prompt = rag_prompt(tokenizer, 1000, seed=100 + i)
            prompts.append(prompt)
            all_docs += docs
        settings = {
            "max_total_tokens": 40_000,
            "extra_args": ("--chunked-prefill-size", "16384"),
            "env": threads_env,
        }
        with smollm2_server("request-shapes-concurrency", **settings) as config:
            register_documents(config.url, all_docs)
            report["concurrency"] = measure_concurrency(config.url, prompts, args.repeats)
    if "in_process" not in args.skip:
        threads = args.threads or os.cpu_count() or 1
        report["in_process_batch"] = measure_in_process(args.repeats, args.concurrent, threads)
    write_json(args.out, report, indent=2)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
