"""Decode step time with and without decode-time eviction after a fused prefill, on the server.

SmolLM2-135M CPU server (fp32 KV, the `torch_position` attention backend). Prompts: HotpotQA
questions, each with its own paragraphs plus paragraphs of the other questions until it has
`--prompt-tokens` tokens, every paragraph registered as a chunk and the order shuffled per
prompt. A round sends `--batch` such fused requests at once (r = 0.15), each decoding
`--decode-tokens` tokens (ignore_eos, streamed one token per event). Decode step = the median gap
between a request's consecutive tokens while every request of the round is decoding (after the
last first token, before the first request ends), so prefills never fall inside it. Modes, in
turn within each of `--repeats` rounds on one server: `all rows` (no eviction) and
`capacity C` (`fusion_decode_capacity` C: each layer and KV head attends the prompt's text
outside the chunks and its top chunk tokens by the observation window's attention, C of the
prompt in all). Also one request alone, where the weights, not the KV, set the step on a CPU.

Quality is not measured here (SmolLM2 does not answer HotpotQA): the answers' F1 with and
without eviction come from `benchmarks/fusion_retention.py --model qwen --min-prompt-tokens 3000
--methods reuse,default@0.15,default@0.15:keep0.25,...` (the same selection code in the fusion
core), summarised into this file's JSON when `--quality` exists.

    python -m benchmarks.decode_eviction [--batch 8] [--prompt-tokens 3000] [--capacity 0.25]
-> benchmarks/results/decode_eviction.json (+ .png)
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path
from typing import Any

import requests

from benchmarks.fusion_quality import chatml_prompt
from benchmarks.plots import plot_decode_eviction
from benchmarks.smollm2_server import (
    MODEL,
    RESULTS,
    server_benchmark_parser,
    smollm2_server,
    smollm2_tokenizer,
)
from sglang_hicache_ext.evaluation.hotpotqa import load_hotpotqa
from sglang_hicache_ext.sglang_ext.tools.streaming_client import stream_generate

RATIO = 0.15
QUALITY = RESULTS / "decode_eviction_quality_qwen.json"


def build_prompts(count: int, min_tokens: int) -> tuple[list[str], list[str]]:
    """`count` long RAG prompts and every paragraph they use (the chunks to register)."""
    tokenizer = smollm2_tokenizer()
    examples = load_hotpotqa(count + 30, seed=31)
    pool = [doc for example in examples[count:] for doc in example.documents]
    prompts, used = [], set()
    for index, example in enumerate(examples[:count]):
        rng = random.Random(index)
        documents = list(example.documents)
        extra = rng.sample(pool, len(pool))
        while len(tokenizer.encode(chatml_prompt(documents, example.question))) < min_tokens:
            documents.append(extra.pop())
        rng.shuffle(documents)
        used.update(documents)
        prompts.append(chatml_prompt(documents, example.question))
    return prompts, sorted(used)


def _body(prompt: str, decode_tokens: int, capacity: float | None) -> dict[str, Any]:
    custom: dict[str, Any] = {"fusion": True, "fusion_recompute_ratio": RATIO}
    if capacity is not None:
        custom["fusion_decode_capacity"] = capacity
    return {
        "text": prompt,
        "sampling_params": {
            "max_new_tokens": decode_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "custom_params": custom,
        },
    }


def one_round(url: str, prompts: list[str], decode_tokens: int, capacity: float | None) -> dict:
    """All prompts at once; the median token gap while all of them decode."""

    def run(prompt: str) -> tuple[float, Any]:
        began = time.perf_counter()
        return began, stream_generate(url, _body(prompt, decode_tokens, capacity), timeout=1800)

    with ThreadPoolExecutor(len(prompts)) as pool:
        runs = list(pool.map(run, prompts))
    arrivals = [[began + t for t in result.token_times_s] for began, result in runs]
    start = max(times[0] for times in arrivals)
    end = min(times[-1] for times in arrivals)
    gaps = [
        later - earlier
        for times in arrivals
        for earlier, later in zip(times, times[1:], strict=False)
        if earlier >= start and later <= end
    ]
    if len(gaps) < 10:
        raise SystemExit("too few steps with every request decoding: raise --decode-tokens")
    infos = [(result.meta.get("hicache_ext_fusion") or [{}])[0] for _, result in runs]
    if not all(info.get("fused") for info in infos):
        raise SystemExit(f"a request was not fused: {infos}")
    return {
        "step_s": statistics.median(gaps),
        "steps": len(gaps),
        "prompt_tokens": [result.meta["prompt_tokens"] for _, result in runs],
        "kept_tokens": [info.get("decode_kept_tokens") for info in infos],
        "unused_tokens": [info.get("decode_unused_tokens") for info in infos],
        "ttft_s": statistics.median(result.ttft_s for _, result in runs),
    }


def measure(url: str, prompts: list[str], args: Any) -> dict[str, Any]:
    modes = {"all rows": None, f"capacity {args.capacity}": args.capacity}
    out: dict[str, Any] = {}
    for batch in sorted({1, args.batch}):
        rounds: dict[str, list[dict]] = {mode: [] for mode in modes}
        for repeat in range(args.repeats):
            for mode, capacity in modes.items():
                rounds[mode].append(one_round(url, prompts[:batch], args.decode_tokens, capacity))
                print(f"batch {batch} round {repeat} {mode}: {rounds[mode][-1]['step_s']:.4f} s")
        steps = {
            mode: statistics.median(r["step_s"] for r in runs) for mode, runs in rounds.items()
        }
        base, evicted = steps.values()
        out[str(batch)] = {
            "median_step_s": steps,
            "step_ratio": evicted / base,
            "rounds": rounds,
        }
    return out


def quality_summary(path: Path) -> dict[str, Any] | None:
    """F1 retention with and without eviction from benchmarks/fusion_retention.py's file."""
    if not path.exists():
        return None
    report = json.loads(path.read_text())
    pick = ("retention", "retention_ci95", "f1", "agree", "kl", "kept", "answered_by_full")
    return {
        "file": path.name,
        "model": report["model"],
        "questions": len(report["rows"]),
        "median_prompt_tokens": statistics.median(row["prompt_tokens"] for row in report["rows"]),
        "methods": {
            method: {key: values.get(key) for key in pick}
            for method, values in report["summary"].items()
        },
    }


def main() -> int:
    parser = server_benchmark_parser(__doc__, "decode_eviction.json")
    parser.set_defaults(repeats=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--decode-tokens", type=int, default=160)
    parser.add_argument("--capacity", type=float, default=0.25)
    parser.add_argument("--quality", type=Path, default=QUALITY)
    args = parser.parse_args()
    prompts, paragraphs = build_prompts(args.batch, args.prompt_tokens)
    folder = Path(tempfile.mkdtemp(prefix="bench-decode-eviction-"))
    (folder / "hicache_ext.json").write_text(json.dumps({"chunk_registrations_per_minute": 0}))
    env = {"SGLANG_HICACHE_EXT_CONFIG": str(folder / "hicache_ext.json")}
    tokens = args.batch * (args.prompt_tokens + 600 + args.decode_tokens) + 8192
    with smollm2_server("decode-eviction", env=env, max_total_tokens=tokens) as config:
        for paragraph in paragraphs:
            response = requests.post(config.url + "/chunks", json={"text": paragraph}, timeout=600)
            if response.status_code != 200:
                raise SystemExit(f"/chunks answered {response.status_code}: {response.text}")
        one_round(config.url, prompts[:2], 16, args.capacity)  # warm-up, not measured
        batches = measure(config.url, prompts, args)
    report = {
        "date": date.today().isoformat(),
        "model": MODEL,
        "device": "cpu (2 cores)",
        "recompute_ratio": RATIO,
        "capacity": args.capacity,
        "decode_tokens": args.decode_tokens,
        "chunks": len(paragraphs),
        "batches": batches,
        "quality": quality_summary(args.quality),
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    plot_decode_eviction(args.out, args.out.with_suffix(".png"))
    for batch, row in batches.items():
        print(f"batch {batch}: {row['median_step_s']} -> ratio {row['step_ratio']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
