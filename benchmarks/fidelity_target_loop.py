"""The closed loop through the real server: "auto" with a token-agreement target, starting from a
low ratio, settles where its shadow checks meet the target; then the TTFT at the settled ratio.

Qwen2.5-Coder-0.5B (fp32, CPU) behind the plugin. The server starts from a ratio table whose host
tier holds r = 0.15 (`--start`, also the tier's floor), `fusion_recompute_ratio: "auto"`,
`fusion_target_agreement` = each `--targets` value in turn (one fresh server per target) and
every fused request checked (`fusion_shadow_rate: 1`). Requests: HotpotQA distractor questions
outside the 200 evaluation questions (seed 2026) and the dev questions (seed 7), each prompt's
paragraphs registered after the chat prefix before it is asked (the harness's prompt), greedy
answers of at most 16 tokens, one at a time, each check run before the next request (the check
waits for the server to be idle). Per request: the ratio it was fused at and its check's token
agreement. Settled: the ratio held after its last move, if that came by request `--settle`;
held: the mean token agreement of the requests fused at it. Then on the same server, at it, fused vs
normal TTFT on `--ttft-prompts` prompts of >= `--min-tokens` tokens (padded with paragraphs of
other questions, all registered), medians.

    python -m benchmarks.fidelity_target_loop --targets 0.85,0.95 --requests 150
-> benchmarks/results/fidelity_target_loop_qwen.json, .png

`--append` adds targets run in another session to the report (a target run again replaces its
earlier run, kept under `superseded_runs`); `--append --ttft-at R` measures
only the TTFT at ratio R for the named targets' runs (the same prompts: keep `--requests`).
`--model smollm2` runs the same loop on SmolLM2-135M (about 8x faster on this CPU, answers
that say little: its figures show the controller at work, not Qwen2.5's fidelity).
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

import requests
from tqdm import tqdm

from benchmarks.fidelity_live import ask
from benchmarks.fusion_quality import chat_prefix, chatml_prompt
from benchmarks.smollm2_server import RESULTS
from sglang_hicache_ext.evaluation.hotpotqa import HotpotQAExample, load_hotpotqa
from sglang_hicache_ext.evaluation.model_paths import QWEN_CODER, SMOLLM2, prepared_model
from sglang_hicache_ext.sglang_ext.config.settings_sources import CONFIG_ENV_VAR
from sglang_hicache_ext.sglang_ext.frontend import wait_for_shadow_check
from sglang_hicache_ext.sglang_ext.server.launcher import ServerConfig, running_server
from sglang_hicache_ext.sglang_ext.server.ports import free_port
from sglang_hicache_ext.tuning.ratio.table import RatioTable, TunedRatio

LOOP_SEED = 101
EVALUATION = (200, 2026)  # the retention harness's questions
DEV = (12, 7)  # the questions methods were chosen on


def loop_questions(count: int) -> list[HotpotQAExample]:
    """`count` questions that are neither evaluation nor dev questions."""
    excluded = {e.qid for n, seed in (EVALUATION, DEV) for e in load_hotpotqa(n, seed=seed)}
    pool = [
        e for e in load_hotpotqa(count + len(excluded), seed=LOOP_SEED) if e.qid not in excluded
    ]
    if len(pool) < count:
        raise SystemExit(f"only {len(pool)} questions outside the evaluation and dev sets")
    return pool[:count]


def chat_model(choice: str) -> tuple[str, Path, Any, list[int]]:
    """The model `--model` names ("qwen" or "smollm2"): its name, prepared folder, tokenizer and
    the token ids that end an answer."""
    from transformers import AutoTokenizer

    name = {"qwen": QWEN_CODER, "smollm2": SMOLLM2}[choice]
    model = prepared_model(name)
    if model is None:
        raise SystemExit(f"{name} is not prepared: run `make models` / `make models-qwen`")
    tokenizer = AutoTokenizer.from_pretrained(model)
    stop = sorted({tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id})
    return name, model, tokenizer, stop


def register(url: str, tokenizer: Any, paragraphs: list[str]) -> None:
    prefix = tokenizer.encode(chat_prefix(), add_special_tokens=False)
    for paragraph in paragraphs:
        tokens = tokenizer.encode(paragraph, add_special_tokens=False)
        response = requests.post(
            url + "/chunks", json={"input_ids": tokens, "prefix": prefix}, timeout=600
        )
        response.raise_for_status()


def run_loop(
    url: str, tokenizer: Any, examples: list[HotpotQAExample], stop: list[int]
) -> list[dict[str, Any]]:
    steps = []
    for example in tqdm(examples, desc="requests", disable=None):
        register(url, tokenizer, list(example.documents))
        shuffled = random.Random(example.qid).sample(
            list(example.documents), len(example.documents)
        )
        ids = tokenizer.encode(chatml_prompt(shuffled, example.question), add_special_tokens=False)
        fused = ask(url, ids, {"fusion": True}, stop)
        info = (fused["meta"].get("hicache_ext_fusion") or [{}])[-1]
        check = wait_for_shadow_check(url, str(fused["meta"]["id"]))
        steps.append(
            {
                "qid": example.qid,
                "recompute_ratio": info.get("recompute_ratio"),
                "ratio_source": info.get("ratio_source"),
                "token_agreement": None if check is None else check["token_agreement"],
                "first_token_agree": None if check is None else check["first_token_agree"],
            }
        )
        # One line a request: a run of hours leaves its trace in the log even if it is cut.
        tqdm.write(f"request {len(steps)}: {json.dumps(steps[-1])}")
    return steps


def padded_prompt(
    example: HotpotQAExample, others: list[HotpotQAExample], tokenizer: Any, min_tokens: int
) -> tuple[list[str], list[int]]:
    """The example's paragraphs and others' until the prompt has `min_tokens` tokens."""
    documents = list(example.documents)
    extra = [d for other in others if other.qid != example.qid for d in other.documents]
    random.Random(example.qid).shuffle(extra)
    while True:
        shuffled = random.Random(example.qid).sample(documents, len(documents))
        ids = tokenizer.encode(chatml_prompt(shuffled, example.question), add_special_tokens=False)
        if len(ids) >= min_tokens or not extra:
            return documents, ids
        documents.append(extra.pop())


def ttft_at(
    url: str,
    tokenizer: Any,
    examples: list[HotpotQAExample],
    ratio: float,
    min_tokens: int,
    stop: list[int],
) -> dict[str, Any]:
    """Fused at `ratio` vs normal TTFT, prompt by prompt on the same server."""
    pairs = []
    for example in examples:
        documents, ids = padded_prompt(example, examples, tokenizer, min_tokens)
        register(url, tokenizer, documents)
        normal = ask(url, ids, {"fusion": False}, stop)
        fused = ask(
            url,
            ids,
            {"fusion": True, "fusion_recompute_ratio": ratio, "fusion_shadow": False},
            stop,
        )
        pairs.append((len(ids), normal["ttft_s"], fused["ttft_s"]))
    return {
        "ratio": ratio,
        "prompt_tokens": [n for n, _, _ in pairs],
        "normal_ttft_s": statistics.median(t for _, t, _ in pairs),
        "fused_ttft_s": statistics.median(t for _, _, t in pairs),
        "ttft_ratio_median": statistics.median(f / n for _, n, f in pairs),
    }


def summarise(steps: list[dict[str, Any]], target: float, settle_by: int) -> dict[str, Any]:
    """Settled: the ratio held from the request after its last move to the end of the run, if
    that move came by request `settle_by`; held: the mean token agreement of the requests fused
    at it (the request that first used it on)."""
    ratios = [round(s["recompute_ratio"], 4) for s in steps]
    moves = [i for i in range(1, len(ratios)) if ratios[i] != ratios[i - 1]]
    first = (moves[-1] if moves else 0) + 1  # 1-based request that first used the final ratio
    settled = ratios[-1] if steps and first <= settle_by else None
    after = [s["token_agreement"] for s in steps[first - 1 :] if s["token_agreement"] is not None]
    held = statistics.fmean(after) if after and settled is not None else None
    return {
        "target": target,
        "start_ratio": ratios[0] if steps else None,
        "moves": [{"request": i + 1, "ratio": ratios[i]} for i in moves],
        "settled_ratio": settled,
        "settled_from_request": first if settled is not None else None,
        "requests_after_settle": len(after) if settled is not None else 0,
        "agreement_after_settle": held,
        "within_0_05": held is not None and abs(held - target) <= 0.05,
        "checked": sum(s["token_agreement"] is not None for s in steps),
    }


def plot(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, dpi=110)
    for run, color in zip(report["runs"], ("tab:blue", "tab:orange", "tab:green"), strict=False):
        steps = run["steps"]
        xs = range(1, len(steps) + 1)
        target = run["summary"]["target"]
        top.step(xs, [s["recompute_ratio"] for s in steps], where="post", color=color,
                 label=f"target {target}")  # fmt: skip
        values = [s["token_agreement"] for s in steps]
        rolling = [
            statistics.fmean(v for v in values[max(0, i - 15) : i + 1] if v is not None)
            for i in range(len(values))
        ]
        bottom.plot(xs, rolling, color=color, label=f"target {target}: last 16 checks")
        bottom.axhline(target, color=color, linestyle=":", linewidth=1)
    top.set_ylabel("recompute ratio (host tier)")
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    bottom.set_ylabel("token agreement")
    bottom.set_xlabel("request")
    bottom.legend(fontsize=8)
    bottom.grid(alpha=0.3)
    figure.suptitle(
        f'{report["model"]}: "auto" with a token-agreement target, from r = {report["start"]}',
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(out)
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="0.85,0.95")
    parser.add_argument("--requests", type=int, default=150)
    parser.add_argument("--settle", type=int, default=100, help="settled by this request")
    parser.add_argument("--start", type=float, default=0.15)
    parser.add_argument("--ttft-prompts", type=int, default=5)
    parser.add_argument("--min-tokens", type=int, default=3000)
    parser.add_argument("--model", choices=("qwen", "smollm2"), default="qwen")
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--append", action="store_true", help="add these targets' runs to an existing --out"
    )
    parser.add_argument(
        "--ttft-at",
        type=float,
        help="with --append: only measure the TTFT at this ratio for the targets' earlier runs",
    )
    args = parser.parse_args()
    name, model, tokenizer, stop = chat_model(args.model)
    out = args.out or RESULTS / f"fidelity_target_loop_{args.model}.json"
    examples = loop_questions(args.requests + args.ttft_prompts)
    report: dict[str, Any] = {
        "model": name,
        "command": " ".join(sys.argv),
        "start": args.start,
        "runs": [],
    }
    if args.append and out.exists():
        # Targets run in separate sessions: one report, each run with the command that made it.
        report = json.loads(out.read_text())
        for run in report["runs"]:
            run.setdefault("command", report["command"])
        report["command"] = " | ".join(dict.fromkeys([report["command"], " ".join(sys.argv)]))
        for run in report["runs"]:  # read again with this script's definition of settled
            run["summary"] = summarise(run["steps"], run["summary"]["target"], args.settle)
    elif args.ttft_at is not None:
        raise SystemExit("--ttft-at adds to the runs of an existing report: give --append")
    for target in (float(t) for t in args.targets.split(",")):
        workdir = Path(tempfile.mkdtemp(prefix="fidelity-loop-"))
        table = workdir / "ratios.json"
        start = TunedRatio(args.start, args.start, args.start, 1.0, "closed-loop start")
        RatioTable(Path(model).name, {"host": start}).save(table)
        settings = workdir / "settings.json"
        settings.write_text(
            json.dumps(
                {
                    "fusion_recompute_ratio": "auto",
                    "fusion_ratio_table": str(table),
                    "fusion_target_agreement": target,
                    "fusion_shadow_rate": 1.0,
                    "fusion_shadow_idle_s": 0.1,
                }
            )
        )
        config = ServerConfig(
            model_path=str(model),
            port=free_port(),
            max_total_tokens=32768,
            env={CONFIG_ENV_VAR: str(settings)},
        )
        with running_server(config, log_path=workdir / "server.log"):
            if args.ttft_at is not None:
                run = next(r for r in report["runs"] if r["summary"]["target"] == target)
                if run.get("ttft_at_settled"):
                    run["ttft_earlier"] = run["ttft_at_settled"]
                run["ttft_at_settled"] = ttft_at(
                    config.url,
                    tokenizer,
                    examples[args.requests :],
                    args.ttft_at,
                    args.min_tokens,
                    stop,
                )
                run["ttft_command"] = " ".join(sys.argv)
                out.write_text(json.dumps(report, indent=1) + "\n")
                print(json.dumps(run["ttft_at_settled"], indent=1), flush=True)
                continue
            steps = run_loop(config.url, tokenizer, examples[: args.requests], stop)
            summary = summarise(steps, target, args.settle)
            ttft = None
            if summary["settled_ratio"] is not None and args.ttft_prompts:
                ttft = ttft_at(
                    config.url,
                    tokenizer,
                    examples[args.requests :],
                    summary["settled_ratio"],
                    args.min_tokens,
                    stop,
                )
        if args.append:  # a target run again replaces its earlier run, which is kept aside
            earlier = [r for r in report["runs"] if r["summary"]["target"] == target]
            report.setdefault("superseded_runs", []).extend(earlier)
            report["runs"] = [r for r in report["runs"] if r["summary"]["target"] != target]
        report["runs"].append(
            {
                "summary": summary,
                "ttft_at_settled": ttft,
                "command": " ".join(sys.argv),
                "steps": steps,
            }
        )
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps({"summary": summary, "ttft_at_settled": ttft}, indent=1), flush=True)
    plot(report, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
