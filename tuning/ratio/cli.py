"""`python -m sglang_hicache_ext.tuning.ratio` (`hicache-ext-ratio`): profile, tune, project.

    profile  --url URL --model NAME --tier host|disk --out profile.json [--prompts FILE]
    tune     --url URL --profile profile.json --table ratios.json [--r-min R] [--prompts FILE]
    project  [--tokens 4096] [--r-min 0.15] [--out projection.json]

`profile` and `tune` talk to a running server whose chunks are served from the tier named (a
disk tier alone: `chunk_store_bytes` smaller than one chunk). Prompts: a JSONL file of
{"documents": [...], "question": "..."} (documents are registered as chunks), or synthetic ones
of about `--prompt-words` words in `--documents` documents; TTFT depends on lengths, not words.
The table written by `tune` is the server's `fusion_ratio_table`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path

from sglang_hicache_ext.tuning.ratio.calibration import (
    DEFAULT_R_MIN,
    TierProfile,
    profile_tier,
    tune_tier,
    tuned_ratio,
)
from sglang_hicache_ext.tuning.ratio.projection import (
    GPU_TIERS,
    H100_EFFECTIVE_FLOPS,
    LLAMA3_8B,
    project,
)
from sglang_hicache_ext.tuning.ratio.quality_floor import quality_floor
from sglang_hicache_ext.tuning.ratio.server_probe import CalibrationPrompt
from sglang_hicache_ext.tuning.ratio.table import RatioTable, load_ratio_table

WORDS = [
    "river",
    "stone",
    "garden",
    "winter",
    "market",
    "station",
    "engine",
    "letter",
    "harbor",
    "valley",
    "signal",
    "orchard",
    "lantern",
    "meadow",
    "bridge",
    "canyon",
    "archive",
    "compass",
    "furnace",
    "glacier",
    "harvest",
    "island",
    "journey",
    "kettle",
    "ledger",
    "mirror",
    "needle",
    "outpost",
    "pillar",
    "quarry",
    "ribbon",
    "saddle",
    "timber",
    "tunnel",
    "velvet",
    "window",
    "yarrow",
    "anchor",
    "beacon",
    "cellar",
    "dock",
    "ember",
    "fable",
    "gravel",
    "hollow",
    "ivory",
    "jasper",
]


def rag_prompt(documents: Sequence[str], question: str) -> str:
    return "Documents:\n" + "\n\n".join(documents) + f"\n\nQuestion: {question}\nAnswer:"


def synthetic_prompts(
    count: int, documents: int, words: int, seed: int = 0
) -> list[CalibrationPrompt]:
    rng = random.Random(seed)
    prompts = []
    for index in range(count):
        docs = tuple(
            f"Record {index}-{d}: " + " ".join(rng.choice(WORDS) for _ in range(words // documents))
            for d in range(documents)
        )
        prompts.append(CalibrationPrompt(docs, rag_prompt(docs, "Which record is oldest?")))
    return prompts


def read_prompts(path: Path) -> list[CalibrationPrompt]:
    prompts = []
    for line in path.read_text().splitlines():
        if line.strip():
            entry = json.loads(line)
            docs = tuple(entry["documents"])
            prompts.append(CalibrationPrompt(docs, rag_prompt(docs, entry["question"])))
    return prompts


def _prompts(args: argparse.Namespace) -> list[CalibrationPrompt]:
    if args.prompts is not None:
        return read_prompts(args.prompts)
    return synthetic_prompts(args.count, args.documents, args.prompt_words)


def _server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True)
    parser.add_argument("--prompts", type=Path, help="JSONL of {documents, question}")
    parser.add_argument("--count", type=int, default=3, help="synthetic prompts")
    parser.add_argument("--documents", type=int, default=6)
    parser.add_argument("--prompt-words", type=int, default=2400)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    profile = commands.add_parser("profile", help="measure t_c, t_i, t_o of a (model, tier)")
    _server_args(profile)
    profile.add_argument("--model", required=True, help="model folder name (the table's key)")
    profile.add_argument("--tier", required=True, choices=("host", "disk"))
    profile.add_argument("--out", type=Path, required=True)
    tune = commands.add_parser("tune", help="golden-section search from the roofline prior")
    _server_args(tune)
    tune.add_argument("--profile", type=Path, required=True)
    tune.add_argument("--table", type=Path, required=True, help="ratio table to add the tier to")
    tune.add_argument("--r-min", type=float, help="default: the model's quality floor, else 0.15")
    tune.add_argument("--r-max", type=float, default=1.0)
    tune.add_argument("--tolerance", type=float, default=0.02)
    projection = commands.add_parser("project", help="tuned ratios for GPU servers, on paper")
    projection.add_argument("--tokens", type=int, default=4096)
    projection.add_argument("--r-min", type=float, default=DEFAULT_R_MIN)
    projection.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    if args.command == "profile":
        result = profile_tier(args.url.rstrip("/"), args.model, args.tier, _prompts(args))
        args.out.write_text(json.dumps(result.to_json(), indent=1) + "\n")
        costs = result.costs
        print(
            f"{args.model} / {args.tier}: t_c {costs.recompute_s:.3g} s, t_i {costs.load_s:.3g} s,"
            f" t_o {costs.overhead_s:.3g} s per token and layer ({result.layers} layers)"
        )
        return 0
    if args.command == "tune":
        profile_data = TierProfile.from_json(json.loads(args.profile.read_text()))
        floor = quality_floor(profile_data.model)
        r_min = args.r_min
        if r_min is None:
            r_min = floor.ratio if floor is not None and floor.ratio is not None else DEFAULT_R_MIN
        prompts = _prompts(args)
        result = tune_tier(
            args.url.rstrip("/"), prompts, profile_data, r_min, args.r_max, args.tolerance
        )
        table = (
            load_ratio_table(args.table)
            if args.table.exists()
            else RatioTable(profile_data.model, {})
        )
        if table.model != profile_data.model:
            raise SystemExit(
                f"{args.table} is for {table.model}, the profile for {profile_data.model}"
            )
        table.tiers[profile_data.tier] = tuned_ratio(result, len(prompts))
        table.save(args.table)
        print(
            f"{profile_data.tier}: r* = {result.ratio:.3f} (prior {result.prior:.3f}, bounds "
            f"[{r_min}, {args.r_max}], {len(result.probes)} evaluations) -> {args.table}"
        )
        return 0
    rows = project(LLAMA3_8B, H100_EFFECTIVE_FLOPS, GPU_TIERS, args.tokens, args.r_min)
    print(
        f"{LLAMA3_8B.name} on H100 (bf16, {H100_EFFECTIVE_FLOPS / 1e12:.0f} TFLOPS effective), "
        f"{args.tokens} chunk tokens, r_min {args.r_min}"
    )
    print(
        f"{'tier':<30}{'t_c (s)':>10}{'t_i (s)':>10}{'r0':>7}{'TTFT r0':>10}{'r_min':>10}{'full':>10}"
    )
    for row in rows:
        print(
            f"{row.tier:<30}{row.costs.recompute_s:>10.2e}{row.costs.load_s:>10.2e}"
            f"{row.prior:>7.3f}{row.ttft_at_prior_s * 1e3:>8.1f}ms"
            f"{row.ttft_at_r_min_s * 1e3:>8.1f}ms{row.full_prefill_s * 1e3:>8.1f}ms"
        )
    if args.out is not None:
        args.out.write_text(json.dumps([r._asdict() for r in rows], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
