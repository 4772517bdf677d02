"""Whether a shadow check's rows should serve the same documents later (`fusion_shadow_refresh`):
live token agreement with it off and on, the same requests, one server after the other.

Qwen2.5-Coder-0.5B (fp32, CPU) behind the plugin, the ratio fixed (`--ratio`, 0.15 by default;
no target, so only the rows differ between the arms) and every fused answer checked
(`fusion_shadow_rate: 1`). Workload: document sets that come back, as RAG traffic over a fixed
corpus does: `--questions` HotpotQA distractor questions outside the evaluation and dev sets,
each prompt's paragraphs registered after the chat prefix (the harness's prompt), each question
asked `--asks` times in a different order of its paragraphs, one after the other, each check
run before the next request. Per ask: the check's token agreement (the served tokens that are
the normal prefill's greedy choice, first `fusion_shadow_tokens` = 16) and how many chunks were
read as an earlier check computed them (`chunk_prefixes.in_context`). The first ask of a set
has nothing kept, so it is the same in both arms (a determinism check); the later asks are the
comparison, paired by (question, ask), with a bootstrap interval of the mean difference.

    python -m benchmarks.shadow_refresh --questions 10 --asks 3
-> benchmarks/results/shadow_refresh_qwen.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from benchmarks.fidelity_live import ask
from benchmarks.fidelity_target_loop import chat_model, loop_questions, register
from benchmarks.fusion_quality import chatml_prompt
from benchmarks.smollm2_server import RESULTS
from sglang_hicache_ext.evaluation.hotpotqa import HotpotQAExample
from sglang_hicache_ext.sglang_ext.config.settings_sources import CONFIG_ENV_VAR
from sglang_hicache_ext.sglang_ext.frontend import wait_for_shadow_check
from sglang_hicache_ext.sglang_ext.server.launcher import ServerConfig, running_server
from sglang_hicache_ext.sglang_ext.server.ports import free_port


def orders(example: HotpotQAExample, asks: int) -> list[list[str]]:
    """`asks` different orders of the example's paragraphs (seeded by its id)."""
    rng = random.Random(example.qid)
    documents = list(example.documents)
    seen: list[list[str]] = []
    while len(seen) < asks:
        order = rng.sample(documents, len(documents))
        if order not in seen:
            seen.append(order)
    return seen


def run_arm(
    model: str,
    refresh: bool,
    ratio: float,
    examples: list[HotpotQAExample],
    asks: int,
    tokenizer: Any,
    stop: list[int],
) -> list[dict[str, Any]]:
    workdir = Path(tempfile.mkdtemp(prefix="shadow-refresh-"))
    settings = workdir / "settings.json"
    settings.write_text(
        json.dumps(
            {
                "fusion_recompute_ratio": ratio,
                "fusion_target_agreement": None,
                "fusion_shadow_rate": 1.0,
                "fusion_shadow_idle_s": 0.1,
                "fusion_shadow_refresh": refresh,
            }
        )
    )
    config = ServerConfig(
        model_path=model,
        port=free_port(),
        max_total_tokens=32768,
        env={CONFIG_ENV_VAR: str(settings)},
    )
    rows = []
    with running_server(config, log_path=workdir / "server.log"):
        for example in tqdm(examples, desc=f"refresh {'on' if refresh else 'off'}", disable=None):
            register(config.url, tokenizer, list(example.documents))
            for index, order in enumerate(orders(example, asks)):
                prompt = chatml_prompt(order, example.question)
                ids = tokenizer.encode(prompt, add_special_tokens=False)
                fused = ask(config.url, ids, {"fusion": True}, stop)
                info = (fused["meta"].get("hicache_ext_fusion") or [{}])[-1]
                check = wait_for_shadow_check(config.url, str(fused["meta"]["id"]))
                rows.append(
                    {
                        "qid": example.qid,
                        "ask": index + 1,
                        "prompt_tokens": len(ids),
                        "fused": bool(info.get("fused")),
                        "chunks_hit": info.get("chunks_hit"),
                        "in_context": (info.get("chunk_prefixes") or {}).get("in_context"),
                        "recompute_ratio": info.get("recompute_ratio"),
                        "answer": fused["text"],
                        "token_agreement": None if check is None else check["token_agreement"],
                        "first_token_agree": None if check is None else check["first_token_agree"],
                    }
                )
                tqdm.write(json.dumps({"refresh": refresh, **rows[-1]}))
    return rows


def compare(off: list[dict[str, Any]], on: list[dict[str, Any]]) -> dict[str, Any]:
    """Per ask number: mean token agreement, first-token agreement and share of checks that
    agree on every served token, off and on; the later asks paired, with a bootstrap interval."""
    key = lambda row: (row["qid"], row["ask"])  # noqa: E731
    by_key = {key(row): row for row in off}
    pairs = [
        (by_key[key(row)], row)
        for row in on
        if key(row) in by_key
        and row["token_agreement"] is not None
        and by_key[key(row)]["token_agreement"] is not None
    ]

    def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
        values = [r["token_agreement"] for r in rows]
        return {
            "checks": len(rows),
            "token_agreement": statistics.fmean(values) if values else None,
            "first_token_agreement": statistics.fmean(r["first_token_agree"] for r in rows)
            if rows
            else None,
            "all_tokens_agree": statistics.fmean(v == 1.0 for v in values) if values else None,
            "chunks_in_context": sum(r["in_context"] or 0 for r in rows),
        }

    report: dict[str, Any] = {"by_ask": {}}
    for ask_number in sorted({row["ask"] for _, row in pairs}):
        chosen = [(a, b) for a, b in pairs if a["ask"] == ask_number]
        report["by_ask"][ask_number] = {
            "off": summary([a for a, _ in chosen]),
            "on": summary([b for _, b in chosen]),
        }
    later = [(a, b) for a, b in pairs if a["ask"] > 1]
    first = [(a, b) for a, b in pairs if a["ask"] == 1]
    diffs = np.array([b["token_agreement"] - a["token_agreement"] for a, b in later])
    rng = np.random.default_rng(0)
    means = [rng.choice(diffs, len(diffs)).mean() for _ in range(2000)] if len(diffs) else []
    report["later_asks"] = {
        "off": summary([a for a, _ in later]),
        "on": summary([b for _, b in later]),
        "paired_gain": float(diffs.mean()) if len(diffs) else None,
        "paired_gain_ci95": [float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))]
        if len(means)
        else None,
        "higher": int((diffs > 0).sum()),
        "lower": int((diffs < 0).sum()),
        "equal": int((diffs == 0).sum()),
    }
    report["first_asks_identical"] = all(
        a["answer"] == b["answer"] and a["token_agreement"] == b["token_agreement"]
        for a, b in first
    )
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--asks", type=int, default=3)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--model", choices=("qwen", "smollm2"), default="qwen")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.asks < 2:
        parser.error("--asks must be at least 2: the first ask of a set has nothing kept")
    name, model, tokenizer, stop = chat_model(args.model)
    out = args.out or RESULTS / f"shadow_refresh_{args.model}.json"
    examples = loop_questions(args.questions)
    arms = {
        arm: run_arm(str(model), refresh, args.ratio, examples, args.asks, tokenizer, stop)
        for arm, refresh in (("off", False), ("on", True))
    }
    report = {
        "model": name,
        "command": " ".join(sys.argv),
        "ratio": args.ratio,
        "questions": args.questions,
        "asks": args.asks,
        **compare(arms["off"], arms["on"]),
        "rows": arms,
    }
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
