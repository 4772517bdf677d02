"""What shadow checks cost users: sequential TTFT of fused requests with every answer checked
(`fusion_shadow_rate` 1) against none (0), same prompts, alternating servers in one run.

SmolLM2-135M-Instruct (fp32, CPU) with the server's defaults otherwise ("auto" with its
token-agreement target). Prompts of >= `--min-tokens` tokens, each holding >= `--min-docs`
registered HotpotQA paragraphs (`benchmarks/fusion_speed.py`'s prompts); every request fused,
greedy, `--answer-tokens` tokens, streamed; TTFT = first chunk. The client sends the next
request `--think-s` after the previous answer (0: back to back, as a sequential benchmark; more
than `fusion_shadow_idle_s`: a check starts in every gap and the next request arrives while it
runs, the case that costs a user one check round at most). Each round starts one server per
setting, in alternating order (a prompt's TTFT moves 10-20 % between servers started minutes
apart on this machine, docs/auto-chunks.md); the figure is the median over every request of a
setting, and the median over prompts of each prompt's ratio.

    python -m benchmarks.shadow_cost --rounds 3 --prompts 8 --think-s 0
    python -m benchmarks.shadow_cost --rounds 3 --prompts 8 --think-s 1 --out .../shadow_cost_think1.json
    python -m benchmarks.shadow_cost --rounds 1 --prompts 48 --concurrency 48 --min-tokens 700 \
        --min-docs 2 --out .../shadow_cost_concurrent48.json   # 48 at once (docs fit 2 GiB)
-> benchmarks/results/shadow_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

from benchmarks.auto_reuse_limits import paired_ratio
from benchmarks.fusion_speed import build_prompts
from benchmarks.smollm2_server import RESULTS, smollm2_path, smollm2_tokenizer
from sglang_hicache_ext.sglang_ext.config.settings_sources import CONFIG_ENV_VAR
from sglang_hicache_ext.sglang_ext.frontend import register_documents
from sglang_hicache_ext.sglang_ext.server.launcher import ServerConfig, running_server
from sglang_hicache_ext.sglang_ext.server.ports import free_port
from sglang_hicache_ext.sglang_ext.tools.streaming_client import stream_generate

SETTINGS = {"checked": 1.0, "unchecked": 0.0}


def run_arm(
    rate: float,
    prompts: list[tuple[list[str], str]],
    think_s: float,
    answer_tokens: int,
    concurrency: int = 1,
) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="shadow-cost-"))
    settings = workdir / "settings.json"
    settings.write_text(json.dumps({"fusion_shadow_rate": rate}))
    config = ServerConfig(
        model_path=str(smollm2_path()),
        port=free_port(),
        env={CONFIG_ENV_VAR: str(settings)},
    )

    def ask(index: int, prompt: str) -> float:
        body = {
            "text": prompt,
            "sampling_params": {
                "max_new_tokens": answer_tokens,
                "temperature": 0,
                "custom_params": {"fusion": True},
            },
        }
        answer = stream_generate(config.url, body, timeout=600)
        fused = (answer.meta.get("hicache_ext_fusion") or [{}])[-1].get("fused")
        if not fused:
            raise SystemExit(f"prompt {index} was not fused: {answer.meta}")
        return answer.ttft_s

    ttfts: list[float] = []
    with running_server(config, log_path=workdir / "server.log"):
        register_documents(config.url, [d for docs, _ in prompts for d in docs])
        # Waves of `concurrency` requests sent at once (1: one by one), `think_s` between waves.
        with ThreadPoolExecutor(concurrency) as pool:
            for start in range(0, len(prompts), concurrency):
                if start:
                    time.sleep(think_s)
                wave = list(enumerate(prompts))[start : start + concurrency]
                ttfts.extend(pool.map(lambda item: ask(item[0], item[1][1]), wave))
        checks = requests.get(config.url + "/hicache_ext/shadow_checks", timeout=60).json()
    return {"ttft_s": ttfts, "shadow_counts": checks["counts"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--min-tokens", type=int, default=3000)
    parser.add_argument("--min-docs", type=int, default=6)
    parser.add_argument("--think-s", type=float, default=0.0)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=1, help="requests sent at once")
    parser.add_argument("--out", type=Path, default=RESULTS / "shadow_cost.json")
    args = parser.parse_args()
    if args.concurrency < 1:
        parser.error(f"--concurrency must be at least 1, got {args.concurrency}")
    prompts = build_prompts(args.prompts, args.min_docs, args.min_tokens, smollm2_tokenizer())
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in SETTINGS}
    for round_ in range(args.rounds):
        order = list(SETTINGS) if round_ % 2 == 0 else list(reversed(SETTINGS))
        for arm in order:
            runs[arm].append(
                run_arm(SETTINGS[arm], prompts, args.think_s, args.answer_tokens, args.concurrency)
            )
            print(f"round {round_ + 1} {arm}: {runs[arm][-1]}", flush=True)
    pooled = {arm: [t for run in runs[arm] for t in run["ttft_s"]] for arm in SETTINGS}
    summary = {
        "median_ttft_s": {arm: statistics.median(values) for arm, values in pooled.items()},
        "pooled_ratio": statistics.median(pooled["checked"])
        / statistics.median(pooled["unchecked"]),
        "prompt_by_prompt_ratio": paired_ratio(
            [run["ttft_s"] for run in runs["checked"]],
            [run["ttft_s"] for run in runs["unchecked"]],
        ),
        "shadow_counts_checked_arm": [run["shadow_counts"] for run in runs["checked"]],
    }
    report = {
        "command": " ".join(sys.argv),
        "think_s": args.think_s,
        "concurrency": args.concurrency,
        "prompts": len(prompts),
        "summary": summary,
        "runs": runs,
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
