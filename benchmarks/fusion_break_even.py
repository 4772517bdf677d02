"""Where fusion stops paying: fused / normal TTFT against the share of the prompt already stored.

SmolLM2-135M-Instruct on the CPU server, `auto_chunks` and `fusion_by_default` on, no
registration, the shipped defaults otherwise. Two servers, one after the other, the same
prompts: `fusion_min_matched_share` 0 ("fused": every prompt with a stored chunk is fused,
whatever its share) and 1 ("fallback": every prompt falls back to the normal prefill,
`below_break_even`, and its new paragraphs are still kept, as the fallback does). A pool of
paragraphs, drawn at random from the corpus as the new ones are, is asked once first, so
`auto_chunks` keeps them, then two of them in one fused prompt: the server's first fused batch
pays the model check (a normal prefill and a fused one at ratio 1 beside it), once per server,
reported as the arm's `first_fused_ttft_s` and kept out of the measured prompts; then one prompt
of the measured shape but longer than any measured one (half again as many paragraphs, half of
them from the pool, the rest from paragraphs no measured prompt holds), fused and then with
fusion off: the first long prompts of a process pay for its heap growing to their size (tens of
thousands of page faults), once per server and path, and a measured prompt longer than any
before it paid that growth for whichever of its pair went first (at ratio 1, where the fused
and normal prefills compute the same, the first of a pair to a new length took 5-12 % longer).
Reported as `shaped_warm_up_ttft_s`, `shaped_warm_up_off_ttft_s` and its prompt tokens against
the longest measured prompt's. Then each prompt holds `--per-request` paragraphs, `seen` of them from
the pool and the rest never seen before (kept by this prompt, reused by none), for every `seen`
from 0 to `--per-request`, in a shuffled order per repeat. Each prompt is sent fused (the
server's default ratio, not shadow-checked) and with `{"fusion": false}` (the twin first in
every other pair), the twin's first document behind a number of its own (`auto_reuse.fusion_off_twin`: the fused prompt, in the
prefix tree when it fell back, is not reused; the system prompt's page is, by both), one
request at a time, TTFT the first streamed token; the fusion counters read
between them wait for the pieces the fused prompt kept, so neither request pays for the other's
capture. Each arm reports the shadow checks' counts and the ratio their target holds per tier at
its end. `--ratio R` has the measured fused prompts ask for recompute ratio R instead of the
server's (the fused arm only: a pinned ratio is fused whatever its share).

Per arm and `seen`: the median matched share (the request's matched chunk tokens over its prompt
tokens; the fallback arm's from the fused arm's same prompts), the median of the paired
asked / fusion-off TTFT ratios and the ratio of the medians. The break-even share is where the
fused arm's paired ratio falls to the fallback arm's (linear between the two points around it):
below it the fallback is the faster one, which is what `fusion_min_matched_share` decides. Each
arm is paired with its own fusion-off requests, so drift between the two runs cancels.

    python -m benchmarks.fusion_break_even [--repeats 5 --per-request 6 --seen 0,1,2]
-> benchmarks/results/fusion_break_even.json and .png (`--summary-only` summarises and redraws
the rows of a run)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import requests
from tqdm import tqdm

from benchmarks.auto_reuse import (
    FLAGS,
    corpus_of,
    fused_and_twin,
    fusion_counters,
    fusion_off_twin,
    settings_file,
)
from benchmarks.smollm2_server import (
    report_header,
    server_benchmark_parser,
    smollm2_server,
    write_report,
)
from examples.openai_rag import SYSTEM, ask
from sglang_hicache_ext.fusion.selectors import check_ratio

ARMS = {"fused": 0.0, "fallback": 1.0}  # fusion_min_matched_share of each arm
QUESTION = "Which of these documents names a person first?"


class Traffic(NamedTuple):
    """The pool asked first, the warm-up's prompt of the measured shape (longer than every
    measured prompt), and (seen, paragraphs) of every measured prompt, in order."""

    pool: list[str]
    shaped_warm_up: list[str]
    measured: list[tuple[int, list[str]]]


class WarmUp(NamedTuple):
    """TTFTs of the warm-up's fused prompts: the first (the model check's) and the one of the
    measured shape; that one's TTFT with fusion off, and its prompt tokens."""

    model_check_ttft_s: float
    shaped_ttft_s: float
    shaped_off_ttft_s: float
    shaped_prompt_tokens: int


def prompts(per_request: int, repeats: int, seen_counts: list[int] | None = None) -> Traffic:
    """The traffic of a run: `seen` takes each of `seen_counts` (default 0 to `per_request`)."""
    rng = random.Random(2026)
    counts = list(range(per_request + 1)) if seen_counts is None else seen_counts
    if not all(0 <= seen <= per_request for seen in counts):
        raise SystemExit(f"--seen: counts must lie in [0, {per_request}], got {counts}")
    fresh_needed = repeats * sum(per_request - seen for seen in counts)
    pool_size = 2 * per_request
    # The warm-up's new paragraphs come after those the measured prompts draw from, which stay
    # as they were: the corpus's first paragraphs are the same for a larger size while its
    # examples stay under 1,366 (`random.sample`, which `load_hotpotqa` draws with, changes
    # method there; these sizes are about a tenth of that).
    corpus, _ = corpus_of(pool_size + fresh_needed + per_request)
    corpus, spare = corpus[: pool_size + fresh_needed], corpus[pool_size + fresh_needed :]
    # The pool drawn at random, not the corpus's first paragraphs: those are shorter than the
    # rest (110 against 148 SmolLM2 tokens for a pool of 24), which made a prompt half of whose
    # paragraphs were seen one with 0.42 of its tokens seen.
    rng.shuffle(corpus)
    pool, fresh = corpus[:pool_size], iter(corpus[pool_size:])
    measured: list[tuple[int, list[str]]] = []
    for _ in range(repeats):
        order = list(counts)
        rng.shuffle(order)
        for seen in order:
            docs = rng.sample(pool, seen) + [next(fresh) for _ in range(per_request - seen)]
            rng.shuffle(docs)
            measured.append((seen, docs))
    warm_rng = random.Random(2027)  # its own: the measured prompts' draws stay as they were
    # Half again as many paragraphs as a measured prompt: longer than each of them.
    longest = per_request + (per_request + 1) // 2
    shaped = warm_rng.sample(pool, longest // 2) + spare[per_request - (longest - longest // 2) :]
    warm_rng.shuffle(shaped)
    return Traffic(pool, shaped, measured)


def warm_up(client: Any, url: str, traffic: Traffic) -> WarmUp:
    """Each pool paragraph asked once (`auto_chunks` keeps them, stored before this returns),
    then two of them fused, then the prompt of the measured shape, fused and with fusion off.
    The first fused batch is served after the model check (a normal prefill and a fused one at
    ratio 1 beside it), the first long prompts of each path pay for the heap's growth:
    once-per-server costs, paid here and reported, not by a measured prompt."""
    pool = traffic.pool
    for start in range(0, len(pool), 4):
        ask(client, "default", pool[start : start + 4], QUESTION, system="Warm-up. " + SYSTEM)
    fusion_counters(url)
    first = ask(client, "default", pool[:2], QUESTION, system="Warm-up, fused. " + SYSTEM)
    fusion_counters(url)
    shaped = ask(
        client, "default", traffic.shaped_warm_up, QUESTION, system="Warm-up, shaped. " + SYSTEM
    )
    fusion_counters(url)
    off = ask(
        client,
        "default",
        traffic.shaped_warm_up,
        QUESTION,
        system="Warm-up, shaped, off. " + SYSTEM,
        fusion=False,
    )
    fusion_counters(url)
    return WarmUp(first.ttft_s, shaped.ttft_s, off.ttft_s, shaped.prompt_tokens)


def half_new_parser(description: str, prompts: int, out: Path) -> argparse.ArgumentParser:
    """The command line of a study of the fused arm's half-new prompts: `--prompts` prompts of
    `--per-request` paragraphs, `--seen` of them from the pool, the result in `--out`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--prompts", type=int, default=prompts)
    parser.add_argument("--per-request", type=int, default=12)
    parser.add_argument("--seen", type=int, default=6)
    parser.add_argument("--out", type=Path, default=out)
    return parser


def recompute_ratio(text: str) -> float:
    """A `--ratio` argument: a number in [0, 1] (argparse reports anything else)."""
    ratio = float(text)
    check_ratio(ratio)
    return ratio


@contextmanager
def warmed_server(
    label: str, traffic: Traffic, arm: str = "fused"
) -> Iterator[tuple[Any, Any, WarmUp]]:
    """The server of `arm` (its `fusion_min_matched_share`, `ARMS`) after `warm_up`, an OpenAI
    client of it, and the warm-up's fused TTFTs."""
    import openai

    env = {"SGLANG_HICACHE_EXT_CONFIG": settings_file(arm_settings(arm))}
    with smollm2_server(label, extra_args=FLAGS, env=env) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        yield server, client, warm_up(client, server.url, traffic)


def arm_settings(arm: str) -> dict[str, Any]:
    return {"fusion_by_default": True, "fusion_min_matched_share": ARMS[arm]}


def run(
    url: str, client: Any, measured: list[tuple[int, list[str]]], ratio: float | None = None
) -> dict[str, Any]:
    """One row per measured prompt, and the shadow checks' counts and the ratio "auto" held per
    tier at the end. `ratio`: the recompute ratio the measured fused prompts ask for (None: the
    server's default)."""
    pinned = {} if ratio is None else {"fusion_recompute_ratio": ratio}
    rows = []
    for number, (seen, docs) in enumerate(tqdm(measured, desc="prompts", disable=None)):
        twin = fusion_off_twin(docs, number)
        # Not shadow-checked: the check would start in the idle moment before the fusion-off
        # twin and hold that one up by a round (flattering the fused arm); the ratio is the
        # same either way (a target moves it only after 8 checks at one ratio).
        pair = fused_and_twin(
            url,
            number,
            partial(ask, client, "default", docs, QUESTION, fusion_shadow=False, **pinned),
            partial(ask, client, "default", twin, QUESTION, fusion=False),
        )
        fused, before, after = pair.fused, pair.before, pair.after
        assert pair.off is not None
        off = pair.off
        rows.append(
            {
                "seen": seen,
                "prompt_tokens": fused.prompt_tokens,
                "chunk_tokens": after["chunk_tokens"] - before["chunk_tokens"],
                "reused_rows": after["tokens_reused"] - before["tokens_reused"],
                "fused": after["fused_requests"] > before["fused_requests"],
                "fused_ttft_s": fused.ttft_s,
                "off_ttft_s": off.ttft_s,
                "off_first": pair.off_first,
                "cached_tokens": fused.cached_tokens,
                "off_cached_tokens": off.cached_tokens,
            }
        )
    return {"rows": rows, **shadow_state(url)}


def shadow_state(url: str) -> dict[str, Any]:
    """The shadow checks' counts and, per chunk tier, the ratio their target holds."""
    checks = requests.get(url + "/hicache_ext/shadow_checks", timeout=30).json()
    info = requests.get(url + "/server_info", timeout=30).json()["internal_states"][0]
    target = ((info["hicache_ext"]["fusion"] or {}).get("shadow") or {}).get("target") or {}
    return {
        "shadow_checks": checks["counts"],
        "target_ratios": {tier: state["ratio"] for tier, state in target.get("tiers", {}).items()},
    }


def by_seen(rows: list[dict[str, Any]]) -> dict[str, Any]:
    points: dict[str, Any] = {}
    for seen in sorted({row["seen"] for row in rows}):
        mine = [row for row in rows if row["seen"] == seen]
        fused = statistics.median(row["fused_ttft_s"] for row in mine)
        off = statistics.median(row["off_ttft_s"] for row in mine)
        points[str(seen)] = {
            "prompts": len(mine),
            "median_prompt_tokens": statistics.median(row["prompt_tokens"] for row in mine),
            "matched_share": statistics.median(
                row["chunk_tokens"] / row["prompt_tokens"] for row in mine
            ),
            "reused_share": statistics.median(
                row["reused_rows"] / row["prompt_tokens"] for row in mine
            ),
            "fused_prompts": sum(row["fused"] for row in mine),
            "median_ttft_asked_s": fused,
            "median_ttft_off_s": off,
            "ttft_ratio_of_medians": fused / off,
            "ttft_ratio_paired": statistics.median(
                row["fused_ttft_s"] / row["off_ttft_s"] for row in mine
            ),
        }
    return points


def summarise(arms: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {arm: by_seen(rows) for arm, rows in arms.items()}
    if "fused" in summary and "fallback" in summary:
        share = break_even(summary["fused"], summary["fallback"])
        summary["break_even_matched_share"] = share
        # Fused already the faster arm at the lowest share measured: the crossing lies below.
        summary["break_even_below_lowest_share"] = share is not None and share == min(
            point["matched_share"] for point in summary["fused"].values() if point["fused_prompts"]
        )
    return summary


def break_even(fused: dict[str, Any], fallback: dict[str, Any]) -> float | None:
    """The matched share where the fused arm's paired TTFT ratio falls to the fallback arm's
    (None: it never does), over the `seen` points in order of share from the first fused one."""
    points = sorted(
        (point["matched_share"], point["ttft_ratio_paired"] - fallback[seen]["ttft_ratio_paired"])
        for seen, point in fused.items()
        if point["fused_prompts"] > 0
    )
    for (share_a, gap_a), (share_b, gap_b) in zip(points, points[1:], strict=False):
        if gap_a > 0 >= gap_b:
            return share_a + gap_a / (gap_a - gap_b) * (share_b - share_a)
    if points and points[0][1] <= 0:
        return points[0][0]
    return None


def plot(report: dict[str, Any], out: Any) -> Any:
    import matplotlib.pyplot as plt

    from benchmarks.run_figures import save_run_figure

    figure, axes = plt.subplots(figsize=(6, 4))
    shares = {seen: p["matched_share"] for seen, p in report["summary"]["fused"].items()}
    for arm in report["arms"]:
        points = report["summary"][arm]
        seens = [seen for seen in points if seen != "0"]
        axes.plot(
            [shares[seen] for seen in seens],
            [points[seen]["ttft_ratio_paired"] for seen in seens],
            "o-",
            label=f"{arm} (fusion_min_matched_share {ARMS[arm]:g})",
        )
    axes.axhline(1.0, linestyle="--", color="grey")
    share = report["summary"].get("break_even_matched_share")
    if share is not None:
        at_most = "<= " if report["summary"].get("break_even_below_lowest_share") else ""
        axes.axvline(share, linestyle=":", color="red", label=f"break-even {at_most}{share:.2f}")
    axes.legend()
    axes.set(
        xlabel="prompt tokens matched to stored chunks (share, fused arm)",
        ylabel="TTFT / fusion-off TTFT (median of pairs)",
        ylim=(0, 2),
    )
    return save_run_figure(figure, report, out, "Fusion's break-even: ")


def main() -> int:
    parser = server_benchmark_parser(__doc__ or "", "fusion_break_even.json")
    parser.add_argument("--per-request", type=int, default=6)
    parser.add_argument(
        "--seen",
        type=lambda text: [int(count) for count in text.split(",")],
        help="comma-separated numbers of seen paragraphs to measure (default: 0 to --per-request)",
    )
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument(
        "--ratio",
        type=recompute_ratio,
        help="recompute ratio the measured fused prompts ask for (default: the server's)",
    )
    parser.add_argument(
        "--summary-only", action="store_true", help="summarise and redraw the rows of --out"
    )
    args = parser.parse_args()
    if args.ratio is not None and "fallback" in args.arms.split(","):
        # A request that pins its ratio is fused whatever its matched share (`below_break_even`).
        parser.error("--ratio: a pinned ratio is fused whatever its share; use --arms fused")
    if args.summary_only:
        kept = json.loads(args.out.read_text())
        kept["summary"] = summarise({arm: r["rows"] for arm, r in kept["arms"].items()})
        return write_report(kept, args.out, plot, kept["summary"].get("break_even_matched_share"))
    report: dict[str, Any] = report_header("benchmarks.fusion_break_even")
    traffic = prompts(args.per_request, args.repeats, args.seen)
    report["arms"] = {}
    for arm in args.arms.split(","):
        with warmed_server(f"break-even-{arm}", traffic, arm) as (server, client, warmed):
            report["arms"][arm] = {
                "settings": arm_settings(arm),
                "ratio": args.ratio,
                "first_fused_ttft_s": warmed.model_check_ttft_s,
                "shaped_warm_up_ttft_s": warmed.shaped_ttft_s,
                "shaped_warm_up_off_ttft_s": warmed.shaped_off_ttft_s,
                "shaped_warm_up_prompt_tokens": warmed.shaped_prompt_tokens,
                **run(server.url, client, traffic.measured, args.ratio),
            }
            rows = report["arms"][arm]["rows"]
            longest = max(row["prompt_tokens"] for row in rows)
            report["arms"][arm]["longest_measured_prompt_tokens"] = longest
            if warmed.shaped_prompt_tokens < longest:
                print(
                    f"warning: the warm-up's long prompt ({warmed.shaped_prompt_tokens} tokens) "
                    f"is shorter than the longest measured one ({longest})"
                )
    report["summary"] = summarise({arm: r["rows"] for arm, r in report["arms"].items()})
    brief: dict[str, Any] = {"break_even": report["summary"].get("break_even_matched_share")}
    for arm in report["arms"]:
        brief[arm] = {
            seen: (round(p["matched_share"], 2), round(p["ttft_ratio_paired"], 2))
            for seen, p in report["summary"][arm].items()
        }
    return write_report(report, args.out, plot, brief)


if __name__ == "__main__":
    raise SystemExit(main())
