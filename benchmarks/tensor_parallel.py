"""Fused ÷ normal TTFT at `--tp-size 2` against `--tp-size 1`, on the same prompts, in one run.

Qwen2.5-Coder-0.5B-Instruct (fp32, 14 query / 2 KV heads: 7 / 1 per rank at TP = 2) behind the
plugin on CPU; one server at a time (TP = 1 first, then TP = 2 with a core per rank,
`SGLANG_CPU_OMP_THREADS_BIND="0|1"`). Each prompt holds >= `--min-docs` registered HotpotQA
paragraphs (shuffled) and >= `--min-tokens` tokens, plus a question. Per prompt, after
/flush_cache: the normal prefill, then the default fused request (r = 0.15); TTFT = client
latency of /generate with max_new_tokens=1. Medians over `--repeats` prompts per server; the
figure is (fused ÷ normal at TP = 2) ÷ (fused ÷ normal at TP = 1), which the issue bounds by
1 ± 0.10. Each server's first fused batch is its model check (a normal prefill beside it):
the first prompt, fused once untimed, takes it.

    python -m benchmarks.tensor_parallel [--repeats 5]
-> benchmarks/results/tensor_parallel.json
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.fusion_speed import build_prompts, ttft
from benchmarks.smollm2_server import server_benchmark_parser, write_json
from sglang_hicache_ext.evaluation.model_paths import PREPARE_HINT, QWEN_CODER, prepared_model
from sglang_hicache_ext.sglang_ext.frontend import register_documents
from sglang_hicache_ext.sglang_ext.server.launcher import ServerConfig, flush_cache, running_server
from sglang_hicache_ext.sglang_ext.server.ports import free_port

FUSED = {"fusion": True, "fusion_recompute_ratio": 0.15}  # the default selector
TP_ENV = {1: {}, 2: {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}}


def measure(model: Path, tp: int, prompts: list[tuple[list[str], str]]) -> dict[str, Any]:
    """Normal and fused TTFT of every prompt on one server of `--tp-size tp`."""
    config = ServerConfig(
        model_path=str(model),
        port=free_port(),
        max_total_tokens=16384,
        extra_args=("--tp-size", str(tp)),
        env=TP_ENV[tp],
    )
    log = Path(tempfile.mkdtemp(prefix=f"bench-tp{tp}-")) / "server.log"
    rows = []
    with running_server(config, log_path=log):
        warm_docs, warm_prompt = prompts[0]
        register_documents(config.url, warm_docs)
        _, meta = ttft(config.url, warm_prompt, FUSED)  # the model check's batch, untimed
        if not (meta.get("hicache_ext_fusion") or [{}])[0].get("fused"):
            raise RuntimeError(f"TP = {tp}: the warm-up was not fused: {meta}")
        for docs, prompt in tqdm(prompts, desc=f"tp={tp}", unit="prompt", disable=None):
            register_documents(config.url, docs)
            flush_cache(config.url)
            normal_s, meta = ttft(config.url, prompt, {})
            flush_cache(config.url)
            fused_s, fused_meta = ttft(config.url, prompt, FUSED)
            (info,) = fused_meta["hicache_ext_fusion"]
            if not info.get("fused"):
                raise RuntimeError(f"TP = {tp}: not fused: {info}")
            rows.append(
                {
                    "prompt_tokens": meta["prompt_tokens"],
                    "normal_ttft_s": normal_s,
                    "fused_ttft_s": fused_s,
                    "tokens_recomputed": info["tokens_recomputed"],
                    "tp_ranks_agree": info.get("tp_ranks_agree"),
                }
            )
    normal = statistics.median(row["normal_ttft_s"] for row in rows)
    fused = statistics.median(row["fused_ttft_s"] for row in rows)
    return {
        "median_normal_ttft_s": normal,
        "median_fused_ttft_s": fused,
        "fused_over_normal": fused / normal,
        "prompts": rows,
    }


def tensor_parallel_table(report: dict[str, Any]) -> str:
    """The table of docs/fusion-sglang.md "Tensor parallelism", rendered from the result file."""
    lines = [
        f"{report['model']}, {report['dtype']}, median {report['median_prompt_tokens']:.0f}-token "
        f"prompts, {report['selector']}, medians of {len(report['tp']['1']['prompts'])} prompts:",
        "",
        "| --tp-size | normal TTFT | fused TTFT | fused ÷ normal |",
        "| --- | --- | --- | --- |",
    ]
    for tp, result in report["tp"].items():
        lines.append(
            f"| {tp} | {result['median_normal_ttft_s']:.2f} s | {result['median_fused_ttft_s']:.2f} s "
            f"| {result['fused_over_normal']:.3f} |"
        )
    lines += [
        "",
        f"TP = 2's ratio ÷ TP = 1's: {report['tp2_ratio_over_tp1_ratio']:.3f}.",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = server_benchmark_parser(__doc__, "tensor_parallel.json")
    parser.add_argument("--min-docs", type=int, default=6)
    parser.add_argument("--min-tokens", type=int, default=2000)
    args = parser.parse_args()
    model = prepared_model(QWEN_CODER)
    if model is None:
        raise SystemExit(f"{QWEN_CODER} is not prepared; run `{PREPARE_HINT}` (make models-qwen)")
    from transformers import AutoTokenizer

    prompts = build_prompts(
        args.repeats, args.min_docs, args.min_tokens, AutoTokenizer.from_pretrained(model)
    )
    by_tp = {tp: measure(model, tp, prompts) for tp in (1, 2)}
    relative = by_tp[2]["fused_over_normal"] / by_tp[1]["fused_over_normal"]
    report = {
        "benchmark": "tensor_parallel",
        "command": f"python -m benchmarks.tensor_parallel --repeats {args.repeats}",
        "model": QWEN_CODER,
        "dtype": "float32",
        "selector": "question_attention (the default), r = 0.15",
        "ttft_method": "client latency of /generate with max_new_tokens=1, after /flush_cache",
        "median_prompt_tokens": statistics.median(r["prompt_tokens"] for r in by_tp[1]["prompts"]),
        "tp": {str(tp): result for tp, result in by_tp.items()},
        "tp2_ratio_over_tp1_ratio": relative,
        "within_10_percent": abs(relative - 1) <= 0.10,
    }
    write_json(args.out, report, indent=2)
    print(tensor_parallel_table(report))
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
