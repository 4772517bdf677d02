"""Where the shadow checks take SmolLM2's ratio "auto" on half-new prompts (issue 56).

SmolLM2-135M-Instruct on the CPU server at the shipped defaults (ratio "auto", token-agreement
target 0.9, checks on) with the break-even benchmark's settings and prompts
(`benchmarks/fusion_break_even.py`: `auto_chunks`, `fusion_by_default`,
`fusion_min_matched_share` 0; its warm-up). SmolLM2 has no measured quality floor, so its
ratio starts at 0.3 and only checks lower it, to 0.15 at most. Each of `--prompts` prompts of
`--per-request` paragraphs, `--seen` of them from the pool, is sent fused with
`custom_params.fusion_shadow: true` and the study waits for its check, so that every prompt is
checked (on a busy server checks run only in idle moments). After each: the check's token
agreement and the tier's ratio. `--ratio R`: the prompts ask for ratio R, which the checks
measure and nothing moves (the agreement a lower ratio would give).

    python -m research.checked_ratio      # benchmarks/results/checked_ratio_half_new.json
    python -m research.checked_ratio --ratio 0.15 --out benchmarks/results/checked_ratio_half_new_r0.15.json
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import requests

from benchmarks.auto_reuse import fusion_counters
from benchmarks.fusion_break_even import (
    QUESTION,
    half_new_parser,
    prompts,
    recompute_ratio,
    shadow_state,
    warmed_server,
)
from benchmarks.smollm2_server import RESULTS, report_header, write_json
from examples.openai_rag import ask

CHECK_WAIT_S = 120.0


def checked(url: str, before: int) -> dict[str, Any]:
    """The newest check's result once more than `before` checks are done."""
    deadline = time.monotonic() + CHECK_WAIT_S
    while time.monotonic() < deadline:
        status = requests.get(url + "/hicache_ext/shadow_checks", timeout=30).json()
        if status["counts"].get("checked", 0) > before:
            return dict(status["recent"][-1])
        time.sleep(0.5)
    raise TimeoutError(f"no shadow check finished in {CHECK_WAIT_S:.0f} s")


def main() -> int:
    parser = half_new_parser(__doc__.splitlines()[0], 24, RESULTS / "checked_ratio_half_new.json")
    parser.add_argument(
        "--ratio",
        type=recompute_ratio,
        help="a recompute ratio the prompts ask for: the checks measure it, the target does not "
        "move it (default: the ratio 'auto')",
    )
    args = parser.parse_args()
    pinned = {} if args.ratio is None else {"fusion_recompute_ratio": args.ratio}
    traffic = prompts(args.per_request, args.prompts, [args.seen])
    rows: list[dict[str, Any]] = []
    with warmed_server("checked-ratio", traffic) as (server, client, _):
        for _, docs in traffic.measured:
            done = shadow_state(server.url)["shadow_checks"].get("checked", 0)
            answer = ask(client, "default", docs, QUESTION, fusion_shadow=True, **pinned)
            fusion_counters(server.url)  # the pieces it kept are stored
            check = checked(server.url, done)
            state = shadow_state(server.url)
            rows.append(
                {
                    "ttft_s": answer.ttft_s,
                    "recompute_ratio": check["recompute_ratio"],
                    "token_agreement": check["token_agreement"],
                    "tier": check.get("ratio_tier"),
                    "tier_ratios_after": state["target_ratios"],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        end = shadow_state(server.url)
    agreements = [row["token_agreement"] for row in rows]
    report: dict[str, Any] = {
        **report_header("research.checked_ratio"),
        "ratio_asked": args.ratio,
        "summary": {
            "checks": len(rows),
            "mean_token_agreement": statistics.fmean(agreements),
            "stdev_token_agreement": statistics.stdev(agreements) if len(rows) > 1 else None,
            "ratios_checked": sorted({row["recompute_ratio"] for row in rows}),
            "target_ratios_at_end": end["target_ratios"],
            "shadow_checks": end["shadow_checks"],
        },
        "rows": rows,
    }
    write_json(args.out, report)
    print(json.dumps(report["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
