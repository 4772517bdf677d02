"""Fused vs normal prefill TTFT through the real CPU server, in one run.

SmolLM2-135M-Instruct (fp32, --radix-cache-backend hicache_ext, torch_position). Each prompt
holds >= `--min-docs` registered HotpotQA paragraphs (shuffled) and >= `--min-tokens` tokens,
plus a question. Per prompt, after /flush_cache: the normal prefill, then each fused selector;
TTFT = client latency of /generate with max_new_tokens=1. Medians over `--repeats` prompts;
JSON in benchmarks/results/fusion_speed.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sglang_hicache_ext.evaluation.hotpotqa import load_hotpotqa  # noqa: E402
from sglang_hicache_ext.sglang_ext.frontend import register_documents  # noqa: E402
from sglang_hicache_ext.sglang_ext.server.launcher import (  # noqa: E402
    ServerConfig,
    flush_cache,
    free_port,
    running_server,
)

from scripts.prepare_models import SMOLLM2, prepare  # noqa: E402

MODES: dict[str, dict[str, object]] = {
    "normal": {},
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--min-docs", type=int, default=6)
    parser.add_argument("--min-tokens", type=int, default=3000)
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results" / "fusion_speed.json"
    )
    args = parser.parse_args()

    from transformers import AutoTokenizer

    model = prepare(SMOLLM2)
    prompts = build_prompts(
        args.repeats, args.min_docs, args.min_tokens, AutoTokenizer.from_pretrained(model)
    )
    config = ServerConfig(model_path=str(model), port=free_port())
    runs: dict[str, list[float]] = {mode: [] for mode in MODES}
    details = []
    with running_server(
        config, log_path=Path(tempfile.mkdtemp(prefix="bench-fusion-speed-")) / "server.log"
    ):
        ttft(config.url, "Warm-up request.", {})
        for docs, prompt in prompts:
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
            print(
                f"{row['prompt_tokens']} tokens, {len(docs)} docs: "
                + "  ".join(f"{m} {row[m]['ttft_s']:.2f}s" for m in MODES),
                flush=True,
            )
    medians = {mode: statistics.median(values) for mode, values in runs.items()}
    report = {
        "benchmark": "fusion_speed",
        "model": SMOLLM2,
        "ttft_method": "client latency of /generate with max_new_tokens=1, after /flush_cache",
        "median_ttft_s": medians,
        "ratio_to_normal": {mode: medians[mode] / medians["normal"] for mode in MODES},
        "prompts": details,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{'mode':<12}{'median TTFT':>13}{'x normal':>10}")
    for mode in MODES:
        print(f"{mode:<12}{medians[mode]:>12.2f}s{report['ratio_to_normal'][mode]:>10.3f}")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
