"""Reuse from traffic under memory pressure, live: host memory as before issue 56 (LRU) against
the defaults (adaptive admission, retention by utility).

SmolLM2-135M-Instruct on the CPU server, `auto_chunks` and `fusion_by_default` on, no
registration. Each of `--requests` chat requests holds `--per-request` HotpotQA paragraphs: a
share `--one-off` of them seen in no other request, the rest drawn from `--popular` paragraphs
with Zipf popularity (`--skew`), in random order. Host memory for chunks (`chunk_store_bytes`)
is `--budget` times the popular set's dense KV bytes (fp32 K and V of every layer; a stored
chunk also holds its scores, so the real ratio is a little below), so the one-offs cannot all
stay. One server per arm, one after the other, the same requests in the same order; each
prompt sent fused (the server's default ratio) and with `{"fusion": false}`, the twin first in
every other pair (`paired_ttft_ratios` reports both orders), its first document behind a number
of its own (`auto_reuse.fusion_off_twin`: the fused request's prompt, in the prefix tree when it
fell back to the normal prefill, is not reused; the system prompt's page is, by both), one
request at a time, TTFT the first streamed token (the only token asked for). The fusion
counters read after the fused request wait for the pieces it kept, so neither request pays for
the other's capture. `--fusion-off-in` names the arms that send the fusion-off requests (all by
default), to shorten a long run: the other arms' rows carry those times, but their TTFT ratio
is not written (two servers' prefill times differ from one run to the next by more than the
effects measured). `--arms control` sends both of each pair with fusion off: its ratio is the
benchmark's resolution.

Per request: the tokens of its popular paragraphs seen before in the arm's run, and the
document tokens its fused prefill matched to stored chunks (the fusion counters around it; a
one-off is never seen again, so every match is a popular paragraph's). Reported after the
first fifth (warm-up): matched / seen-before popular tokens, median TTFT fused and fusion off,
the server's capture and admission counters, and how much of the prompts the stored chunks
covered (`matched_shares`: what the break-even fallback decides by).

    python -m benchmarks.reuse_under_pressure [--requests 200 --one-off 0.8 --budget 1.5]
-> benchmarks/results/reuse_under_pressure.json and .png (`--plot-only` redraws the figure,
`--shares-only` adds the matched shares to an earlier run's summary).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from functools import partial
from pathlib import Path
from typing import Any

import requests
from tqdm import tqdm

from benchmarks.auto_reuse import (
    FLAGS,
    corpus_of,
    fused_and_twin,
    fusion_off_twin,
    settings_file,
)
from benchmarks.smollm2_server import (
    RESULTS,
    report_header,
    smollm2_path,
    smollm2_server,
    smollm2_tokenizer,
    write_report,
)
from examples.openai_rag import ask
from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings

# Each arm's host memory: "lru" as before issue 56 (every piece admitted, the least recently
# used dropped); "adaptive" the defaults (admission by frequency or recency, and retention by
# utility: compressed before dropped); "frequency" too with --arms.
ARMS = ("lru", "adaptive")
ARM_SETTINGS = {
    "lru": {"chunk_admission": "lru", "chunk_retention": "lru"},
    "adaptive": {"chunk_admission": "adaptive", "chunk_retention": "utility"},
    "frequency": {"chunk_admission": "frequency", "chunk_retention": "utility"},
    # The defaults' server, and the request that would ask for fusion sent with fusion off as
    # well, so both of a pair are normal prefills: its TTFT ratio is what the benchmark reads
    # where fusion changes nothing, the resolution of the other arms'.
    "control": {"chunk_admission": "adaptive", "chunk_retention": "utility"},
}
CONTROL = "control"
# The shipped fusion_min_matched_share: prompts covered less fall back (`matched_shares`).
BREAK_EVEN = ExtensionSettings().fusion_min_matched_share


def dense_bytes_per_token() -> int:
    """fp32 K and V of one token over every layer of the served model (the CPU server's dtype)."""
    config = json.loads((smollm2_path() / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4


def traffic(
    requests_n: int, per_request: int, popular: int, one_off: float, skew: float
) -> tuple[list[list[str]], list[str], dict[str, str]]:
    """The requests' paragraphs, the popular ones, and a question per paragraph (its example's)."""
    rng = random.Random(2026)
    slots = [[rng.random() < one_off for _ in range(per_request)] for _ in range(requests_n)]
    one_offs = sum(map(sum, slots))
    corpus, questions = corpus_of(popular + one_offs)
    hot, fresh = corpus[:popular], iter(corpus[popular:])
    weights = [1 / (rank + 1) ** skew for rank in range(popular)]
    draws = []
    for flags in slots:
        docs: list[str] = []
        for is_one_off in flags:
            doc = next(fresh) if is_one_off else rng.choices(hot, weights)[0]
            if doc not in docs:
                docs.append(doc)
        rng.shuffle(docs)
        draws.append(docs)
    return draws, hot, questions


def run_arm(
    url: str,
    draws: list[list[str]],
    popular: set[str],
    questions: dict[str, str],
    tokens: dict[str, int],
    desc: str,
    time_fusion_off: bool = True,
    fusion: bool = True,
) -> list[dict[str, Any]]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    seen: set[str] = set()
    rows = []
    for number, docs in enumerate(tqdm(draws, desc=desc, disable=None)):
        question = questions[docs[0]]
        twin = fusion_off_twin(docs, number)
        pair = fused_and_twin(
            url,
            number,
            partial(ask, client, "default", docs, question, max_tokens=1, fusion=fusion),
            partial(ask, client, "default", twin, question, max_tokens=1, fusion=False)
            if time_fusion_off
            else None,
        )
        fused, off, before, after = pair.fused, pair.off, pair.before, pair.after
        rows.append(
            {
                "popular_seen_tokens": sum(tokens[d] for d in docs if d in popular and d in seen),
                "document_tokens": sum(tokens[d] for d in docs),
                "chunk_tokens": after["chunk_tokens"] - before["chunk_tokens"],
                "fused": after["fused_requests"] > before["fused_requests"],
                "fused_ttft_s": fused.ttft_s,
                "off_ttft_s": None if off is None else off.ttft_s,
                "off_first": pair.off_first,
                "prompt_tokens": fused.prompt_tokens,
                "cached_tokens": fused.cached_tokens,
                "off_cached_tokens": None if off is None else off.cached_tokens,
            }
        )
        seen.update(docs)
    return rows


def after_warmup(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The requests reported: all but the first fifth."""
    return rows[len(rows) // 5 :]


def summarise(rows: list[dict[str, Any]], server_info: dict[str, Any]) -> dict[str, Any]:
    later = after_warmup(rows)
    seen_tokens = sum(r["popular_seen_tokens"] for r in later)
    state = server_info["internal_states"][0]["hicache_ext"]
    chunks = state.get("chunks") or {}
    host = {k: v for k, v in chunks.items() if not isinstance(v, (dict, list)) and v is not None}
    return {
        "requests_after_warmup": len(later),
        "popular_seen_tokens_reused": sum(r["chunk_tokens"] for r in later) / max(1, seen_tokens),
        "median_ttft_fused_s": statistics.median(r["fused_ttft_s"] for r in later),
        "median_ttft_off_s": statistics.median(r["off_ttft_s"] for r in later),
        "ttft_ratio_median_of_medians": statistics.median(r["fused_ttft_s"] for r in later)
        / statistics.median(r["off_ttft_s"] for r in later),
        "fused_share": sum(r["fused"] for r in later) / len(later),
        "paired_ttft_ratios": paired_ratios(later),
        "matched_shares": matched_shares(later, BREAK_EVEN),
        "auto_chunks": state.get("auto_chunks"),
        "host": host,
        "host_bytes_by_form": chunks.get("bytes_by_form"),
    }


def paired_ratios(later: list[dict[str, Any]]) -> dict[str, float | None]:
    """Median of each request's TTFT over its fusion-off twin's: over the fused requests, the
    ones not fused, and by which of the pair went first (None where none)."""

    def median(rows: list[dict[str, Any]]) -> float | None:
        ratios = [r["fused_ttft_s"] / r["off_ttft_s"] for r in rows if r["off_ttft_s"]]
        return statistics.median(ratios) if ratios else None

    return {
        "fused": median([r for r in later if r["fused"]]),
        "not_fused": median([r for r in later if not r["fused"]]),
        "fused_first": median([r for r in later if not r.get("off_first")]),
        "off_first": median([r for r in later if r.get("off_first")]),
    }


def matched_shares(later: list[dict[str, Any]], minimum: float) -> dict[str, float]:
    """How much of each prompt its stored chunks covered (matched chunk tokens over prompt
    tokens, a little below the server's share, which leaves out the cached prefix): the median
    over the requests and over the fused ones, and the share of the popular paragraphs'
    seen-before tokens held by prompts covered `minimum` or more (what a break-even at
    `minimum` would still fuse)."""
    share = [r["chunk_tokens"] / r["prompt_tokens"] for r in later]
    fused = [s for s, r in zip(share, later, strict=True) if r["fused"]]
    seen = sum(r["popular_seen_tokens"] for r in later)
    above = sum(r["popular_seen_tokens"] for s, r in zip(share, later, strict=True) if s >= minimum)
    return {
        "minimum": minimum,
        "median": statistics.median(share),
        "median_fused": statistics.median(fused) if fused else 0.0,
        "popular_seen_tokens_at_minimum": above / max(1, seen),
    }


def plot(report: dict[str, Any], out: Path) -> Path:
    """Per arm: the share of seen-before popular tokens reused, cumulative over the requests."""
    import matplotlib.pyplot as plt

    from benchmarks.run_figures import save_run_figure, ttft_ratio_cdf

    figure, (reuse, ttft) = plt.subplots(1, 2, figsize=(11, 4))
    for arm, result in report["arms"].items():
        rows = result["rows"]
        seen = reused = 0
        curve = []
        for row in rows:
            seen += row["popular_seen_tokens"]
            reused += row["chunk_tokens"]
            curve.append(reused / seen if seen else 0.0)
        reuse.plot(range(1, len(rows) + 1), curve, label=f"host memory: {arm}")
        if result.get("fusion_off_timed_in", arm) == arm:  # ratios within one server only
            ratios = [r["fused_ttft_s"] / r["off_ttft_s"] for r in after_warmup(rows)]
            ttft_ratio_cdf(ttft, ratios, arm)
    reuse.axhline(0.9, linestyle="--", color="grey")
    reuse.set(
        xlabel="request",
        ylabel="reused / seen-before popular tokens (cumulative)",
        title="Reuse of the popular documents",
        ylim=(0, 1.05),
    )
    reuse.legend()
    ttft.axvline(1.0, linestyle="--", color="grey")
    ttft.set(title="TTFT after the warm-up, same prompts")
    ttft.legend()
    return save_run_figure(figure, report, out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--per-request", type=int, default=5)
    parser.add_argument("--popular", type=int, default=20)
    parser.add_argument("--one-off", type=float, default=0.8)
    parser.add_argument("--skew", type=float, default=1.0)
    parser.add_argument("--budget", type=float, default=1.5, help="x the popular set's bytes")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument(
        "--min-matched-share",
        type=float,
        default=None,
        help="fusion_min_matched_share of both arms (default: the server's)",
    )
    parser.add_argument(
        "--fusion-off-in", default=None, help="arms that time fusion off (default: all)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "reuse_under_pressure.json")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from --out")
    parser.add_argument(
        "--shares-only", action="store_true", help="add matched_shares to --out's arms"
    )
    args = parser.parse_args()
    if args.plot_only:
        print(plot(json.loads(args.out.read_text()), args.out.with_suffix(".png")))
        return 0
    if args.shares_only:
        report = json.loads(args.out.read_text())
        for result in report["arms"].values():
            rows = result["rows"]
            result["summary"]["matched_shares"] = matched_shares(after_warmup(rows), BREAK_EVEN)
        args.out.write_text(json.dumps(report, indent=1))
        print(
            json.dumps({arm: r["summary"]["matched_shares"] for arm, r in report["arms"].items()})
        )
        return 0
    header = report_header("benchmarks.reuse_under_pressure")  # the code the servers run
    draws, hot, questions = traffic(
        args.requests, args.per_request, args.popular, args.one_off, args.skew
    )
    tokenizer = smollm2_tokenizer()
    everything = {d for docs in draws for d in docs} | set(hot)  # short runs draw not every one
    tokens = {d: len(tokenizer.encode(d, add_special_tokens=False)) for d in everything}
    popular_tokens = sum(tokens[d] for d in hot)
    budget_bytes = int(args.budget * popular_tokens * dense_bytes_per_token())
    arm_names = args.arms.split(",")
    timing_arms = arm_names if args.fusion_off_in is None else args.fusion_off_in.split(",")
    if unknown := sorted(set(arm_names) - set(ARM_SETTINGS)):
        parser.error(f"--arms {args.arms!r}: unknown {unknown}; choose from {sorted(ARM_SETTINGS)}")
    if not set(timing_arms) <= set(arm_names):
        parser.error(f"--fusion-off-in {args.fusion_off_in!r}: not among --arms {args.arms!r}")
    runs: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {}
    for arm in arm_names:
        values = {
            "auto_chunks": True,
            "fusion_by_default": True,
            "chunk_store_bytes": budget_bytes,
            **ARM_SETTINGS[arm],
        }
        if args.min_matched_share is not None:
            values["fusion_min_matched_share"] = args.min_matched_share
        env = {"SGLANG_HICACHE_EXT_CONFIG": settings_file(values)}
        with smollm2_server(f"pressure-{arm}", extra_args=FLAGS, env=env) as server:
            rows = run_arm(
                server.url,
                draws,
                set(hot),
                questions,
                tokens,
                arm,
                arm in timing_arms,
                fusion=arm != CONTROL,
            )
            info = requests.get(server.url + "/server_info", timeout=30).json()
        runs[arm] = rows, info
    arms: dict[str, Any] = {}
    for arm, (rows, info) in runs.items():
        timed_in = arm if arm in timing_arms else timing_arms[0]
        for row, timed in zip(rows, runs[timed_in][0], strict=True):
            row["off_ttft_s"] = timed["off_ttft_s"]  # the same prompt's normal prefill
        summary = summarise(rows, info)
        if timed_in != arm:  # two servers' times: not a ratio (they differ run to run)
            summary["ttft_ratio_median_of_medians"] = None
        arms[arm] = {"summary": summary, "fusion_off_timed_in": timed_in, "rows": rows}
    summary = {
        arm: {
            key: arms[arm]["summary"][key]
            for key in (
                "popular_seen_tokens_reused",
                "median_ttft_fused_s",
                "median_ttft_off_s",
                "ttft_ratio_median_of_medians",
            )
        }
        for arm in arms
    }
    report = {
        **header,
        "popular_tokens": popular_tokens,
        "one_off_share": sum(tokens[d] for docs in draws for d in docs if d not in set(hot))
        / sum(tokens[d] for docs in draws for d in docs),
        "chunk_store_bytes": budget_bytes,
        "fusion_min_matched_share": args.min_matched_share,
        "dense_bytes_per_token": dense_bytes_per_token(),
        "summary": summary,
        "arms": arms,
    }
    return write_report(report, args.out, plot, summary)


if __name__ == "__main__":
    raise SystemExit(main())
