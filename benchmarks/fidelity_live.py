"""Live token agreement of fused answers through the real server, beside the retention harness's
on the same prompts, with the whole-answer agreement and TTFT of each configuration.

Qwen2.5-Coder-0.5B (fp32, CPU) behind the plugin, the retention harness's prompts (HotpotQA
distractor questions, seed 2026; every paragraph registered after the chat prefix, `POST /chunks`
`"prefix"`; the paragraphs shuffled in a ChatML prompt sent as the harness's token ids: see
`benchmarks/retention_chunks.py`), greedy answers of at most 16 tokens stopped at <|im_end|>.
Per question, on one server: the normal prefill (fusion off), then each configuration as a fused
request with `fusion_shadow: true`, each checked by the server's own shadow check (which waits
for the server to be idle) before the next request goes out. Per configuration:

- live token agreement and first-token agreement: the server's checks
  (`GET /hicache_ext/shadow_checks`), the measure of `evaluation/token_agreement.py`;
- whole-answer agreement with the normal prefill's answer (HotpotQA normalisation) and F1
  retention against the gold answers;
- fused TTFT / normal TTFT (streamed, first chunk; the cache flushed before each request), the
  median over questions of the per-question ratio;
- with `--harness FILE` (a `benchmarks/fusion_retention.py` result on the same questions), the
  harness's token agreement of the matching method, question by question.

Configurations: a ratio (`1`, `0.15`, ... with the default selector), `0` (the `reuse` selector:
nothing recomputed) or `default` (no fusion option: the server's defaults, "auto" with its
token-agreement target, learning from these checks as it goes).

    python -m benchmarks.fidelity_live --questions 50 --configs 1,0,0.15,default \
        --harness benchmarks/results/fidelity_target_qwen.json [--resume]
-> benchmarks/results/fidelity_live_qwen.json (rewritten after every question).
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
from typing import Any

import requests
from tqdm import tqdm

from benchmarks.fusion_quality import chat_prefix, chatml_prompt
from benchmarks.smollm2_server import RESULTS
from sglang_hicache_ext.evaluation.answer_quality import f1_score, normalize_answer
from sglang_hicache_ext.evaluation.hotpotqa import load_hotpotqa
from sglang_hicache_ext.evaluation.model_paths import QWEN_CODER, prepared_model
from sglang_hicache_ext.sglang_ext.config.settings_sources import CONFIG_ENV_VAR
from sglang_hicache_ext.sglang_ext.frontend import wait_for_shadow_check
from sglang_hicache_ext.sglang_ext.server.launcher import ServerConfig, flush_cache, running_server
from sglang_hicache_ext.sglang_ext.server.ports import free_port
from sglang_hicache_ext.sglang_ext.tools.streaming_client import stream_generate

SEED = 2026  # the retention harness's question sample
ANSWER_TOKENS = 16
# The harness's method for each configuration (benchmarks/fusion_retention.py names).
HARNESS_METHOD = {
    "0": "reuse+prefix",
    "0.15": "question_attention+sink8+prefix@0.15",
    "0.3": "question_attention+sink8+prefix@0.3",
    "0.5": "question_attention+sink8+prefix@0.5",
    "0.7": "question_attention+sink8+prefix@0.7",
}


def custom_params(config: str) -> dict[str, Any]:
    """The fusion options of one configuration, every request checked."""
    params: dict[str, Any] = {"fusion": True, "fusion_shadow": True}
    if config == "default":
        return params
    if float(config) == 0:
        return {**params, "fusion_selector": "reuse", "fusion_recompute_ratio": 0.0}
    return {**params, "fusion_recompute_ratio": float(config)}


def ask(url: str, ids: list[int], custom: dict[str, Any], stop: list[int]) -> dict[str, Any]:
    flush_cache(url)  # no prefix hit from the previous request of this prompt
    body = {
        "input_ids": ids,
        "sampling_params": {
            "max_new_tokens": ANSWER_TOKENS,
            "temperature": 0,
            "stop_token_ids": stop,
            "skip_special_tokens": True,
            "custom_params": custom,
        },
    }
    answer = stream_generate(url, body, timeout=1800)
    return {"text": answer.text.strip(), "ttft_s": answer.ttft_s, "meta": answer.meta}


def measure_question(
    url: str, example: Any, tokenizer: Any, configs: list[str], stop: list[int]
) -> dict[str, Any]:
    shuffled = random.Random(example.qid).sample(list(example.documents), len(example.documents))
    ids = tokenizer.encode(chatml_prompt(shuffled, example.question), add_special_tokens=False)
    prefix = tokenizer.encode(chat_prefix(), add_special_tokens=False)
    for paragraph in example.documents:
        tokens = tokenizer.encode(paragraph, add_special_tokens=False)
        response = requests.post(
            url + "/chunks", json={"input_ids": tokens, "prefix": prefix}, timeout=600
        )
        response.raise_for_status()
    normal = ask(url, ids, {"fusion": False}, stop)
    row: dict[str, Any] = {
        "qid": example.qid,
        "gold": example.answer,
        "prompt_tokens": len(ids),
        "normal": {"answer": normal["text"], "ttft_s": normal["ttft_s"]},
        "f1_normal": f1_score(normal["text"], example.answer),
        "configs": {},
    }
    for config in configs:
        fused = ask(url, ids, custom_params(config), stop)
        rounds = fused["meta"].get("hicache_ext_fusion") or [{}]
        check = wait_for_shadow_check(url, str(fused["meta"]["id"]))
        row["configs"][config] = {
            "answer": fused["text"],
            "ttft_s": fused["ttft_s"],
            "ttft_ratio": fused["ttft_s"] / normal["ttft_s"],
            "fused": bool(rounds[-1].get("fused")),
            "recompute_ratio": rounds[-1].get("recompute_ratio"),
            "ratio_source": rounds[-1].get("ratio_source"),
            "agree": normalize_answer(fused["text"]) == normalize_answer(normal["text"]),
            "f1": f1_score(fused["text"], example.answer),
            "check": check,
        }
    return row


def _mean_ci(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    half = 1.96 * statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0
    return mean, half


def summarise(rows: list[dict[str, Any]], harness: dict[str, Any] | None) -> dict[str, Any]:
    configs = list(dict.fromkeys(c for row in rows for c in row["configs"]))
    by_qid = {row["qid"]: row for row in (harness or {}).get("rows", [])}
    summary: dict[str, Any] = {}
    for config in configs:
        runs = [(row, row["configs"][config]) for row in rows if config in row["configs"]]
        checked = [(row, run) for row, run in runs if run["check"] is not None]
        tokens = [run["check"]["token_agreement"] for _, run in checked]
        f1 = statistics.fmean(run["f1"] for _, run in runs)
        f1_normal = statistics.fmean(row["f1_normal"] for row, _ in runs)
        item: dict[str, Any] = {
            "questions": len(runs),
            "checked": len(checked),
            "token_agreement": _mean_ci(tokens) if tokens else None,
            "first_token_agreement": statistics.fmean(
                float(run["check"]["first_token_agree"]) for _, run in checked
            )
            if checked
            else None,
            "answer_agreement": statistics.fmean(float(run["agree"]) for _, run in runs),
            "f1_retention": f1 / f1_normal if f1_normal else None,
            "ttft_ratio_median": statistics.median(run["ttft_ratio"] for _, run in runs),
            "ratios": sorted({run["recompute_ratio"] for _, run in runs}, key=str),
        }
        method = "full" if config in ("1", "1.0") else HARNESS_METHOD.get(config)
        if config == "default" and len(item["ratios"]) == 1:
            # The server's own choice: compared with the harness at the ratio it chose.
            method = HARNESS_METHOD.get(f"{item['ratios'][0]:g}")
        paired = [
            (
                run["check"]["token_agreement"],
                1.0
                if method == "full"
                else by_qid[row["qid"]]["methods"][method]["token_agreement"],
            )
            for row, run in checked
            if method is not None
            and row["qid"] in by_qid
            and (method == "full" or method in by_qid[row["qid"]]["methods"])
        ]
        if paired:
            live, offline = zip(*paired, strict=True)
            item["harness"] = {
                "method": method,
                "questions": len(paired),
                "live_token_agreement": statistics.fmean(live),
                "harness_token_agreement": statistics.fmean(offline),
                "difference": statistics.fmean(live) - statistics.fmean(offline),
                "questions_equal": sum(a == b for a, b in paired),
            }
        summary[config] = item
    return summary


def print_table(summary: dict[str, Any]) -> None:
    print(
        "| configuration | ratio used | questions | token agreement (live) [95 % CI] "
        "| harness, same questions | first token | whole answer = normal | F1 retention "
        "| TTFT ÷ normal (median) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for config, item in summary.items():
        tokens = item["token_agreement"]
        live = f"{tokens[0]:.3f} ± {tokens[1]:.3f}" if tokens else "n/a"
        harness = item.get("harness")
        offline = (
            f"{harness['harness_token_agreement']:.3f} (live {harness['live_token_agreement']:.3f},"
            f" n = {harness['questions']})"
            if harness
            else ""
        )
        ratios = ", ".join(f"{r:g}" if isinstance(r, float) else str(r) for r in item["ratios"])
        first = item["first_token_agreement"]
        print(
            f"| `{config}` | {ratios} | {item['questions']} | {live} | {offline} "
            f"| {'' if first is None else f'{first:.2f}'} | {item['answer_agreement']:.2f} "
            f"| {item['f1_retention']:.3f} | {item['ttft_ratio_median']:.3f} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=50)
    parser.add_argument("--configs", default="1,0,0.15,default")
    parser.add_argument("--harness", type=Path)
    parser.add_argument("--out", type=Path, default=RESULTS / "fidelity_live_qwen.json")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--summary-only", action="store_true")
    args = parser.parse_args()
    configs = args.configs.split(",")
    harness = json.loads(args.harness.read_text()) if args.harness else None
    earlier = json.loads(args.out.read_text()) if args.out.exists() else {"rows": []}
    rows: list[dict[str, Any]] = earlier["rows"] if (args.resume or args.summary_only) else []
    if not args.summary_only:
        from transformers import AutoTokenizer

        model = prepared_model(QWEN_CODER)
        if model is None:
            raise SystemExit(f"{QWEN_CODER} is not prepared: run `make models-qwen`")
        tokenizer = AutoTokenizer.from_pretrained(model)
        stop = sorted({tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id})
        workdir = Path(tempfile.mkdtemp(prefix="fidelity-live-"))
        # Checks are forced per request (fusion_shadow); the server's other settings are its
        # defaults, so the `default` configuration is what a fresh server does.
        settings = workdir / "settings.json"
        settings.write_text(json.dumps({"fusion_shadow_rate": 0.0, "fusion_shadow_idle_s": 0.1}))
        config = ServerConfig(
            model_path=str(model),
            port=free_port(),
            max_total_tokens=32768,
            extra_args=("--enable-metrics",),
            env={CONFIG_ENV_VAR: str(settings)},
        )
        done = {row["qid"] for row in rows if all(c in row["configs"] for c in configs)}
        rows = [row for row in rows if row["qid"] in done]
        examples = [e for e in load_hotpotqa(args.questions, seed=SEED) if e.qid not in done]
        with running_server(config, log_path=workdir / "server.log"):
            for example in tqdm(examples, desc="questions", disable=None):
                began = time.perf_counter()
                rows.append(measure_question(config.url, example, tokenizer, configs, stop))
                args.out.write_text(json.dumps({"model": QWEN_CODER, "rows": rows}, indent=1))
                tqdm.write(f"{example.qid}: {time.perf_counter() - began:.0f}s")
            server_info = requests.get(config.url + "/server_info", timeout=60).json()
        shadow = [s["hicache_ext"]["fusion"]["shadow"] for s in server_info["internal_states"]]
    else:
        shadow = earlier.get("server_shadow_window")
    summary = summarise(rows, harness)
    report = {
        "model": QWEN_CODER,
        "command": " ".join(sys.argv),
        "configs": configs,
        "summary": summary,
        "server_shadow_window": shadow,
        "rows": rows,
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print_table(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
