"""Fused TTFT against the recompute ratio per chunk tier, the tuned ratio, sparse and overlapped
loads, with the full prefill of the same prompts on the same server as the baseline.

SmolLM2-135M-Instruct on the CPU server; prompts of >= `--min-tokens` tokens holding >= 6
registered HotpotQA paragraphs (as `fusion_speed`). One server per tier, one after the other:
  dram            chunks in host memory (no disk tier);
  disk            chunks streamed from the local disk tier (`chunk_store_bytes` = 1 keeps every
                  chunk there: nothing is promoted);
  disk_throttled  the same disk capped (`chunk_disk_read_bytes_per_s`) at the rate where loading a
                  token's K/V costs what recomputing it does on this CPU (t_i = t_c, measured on
                  the `disk` server), a stand-in for a slow medium;
  mooncake        chunks in a Mooncake Store on loopback: a master and a separate process lending
                  the store its memory, the server lending none (`chunk_store_bytes` = 1 again), so
                  every chunk is fetched whole from another process over TCP at each request.
Per tier: `tuning.ratio` profiles t_c / t_i / t_o and runs the warm-started golden-section
search (r_min = the model's quality floor, else 0.15); every ratio of the 0.05 grid from r_min
to 1 is measured; the tuned ratio is then compared with the best grid ratio in fresh,
interleaved runs (`--rounds` per prompt each: the minimum of a noisy grid is biased low); on the
disk tiers the
same requests run with and without overlapped loading, with the transfer time the server
measured. TTFT = client latency of /generate with max_new_tokens=1 after /flush_cache, medians
over the prompts. `--tiers` measures some tiers and replaces only theirs in an existing result
file (each tier's baseline is its own server's full prefill, measured in the same run).

    python -m benchmarks.fusion_tiers [--repeats 3] [--tiers mooncake]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import date
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.fusion_speed import build_prompts
from benchmarks.plots import plot_fusion_tiers
from benchmarks.smollm2_server import (
    MODEL,
    server_benchmark_parser,
    smollm2_server,
    smollm2_tokenizer,
    write_json,
)
from sglang_hicache_ext.sglang_ext.server.launcher import ServerConfig
from sglang_hicache_ext.sglang_ext.tools.mooncake_master import running_master
from sglang_hicache_ext.tuning.ratio.calibration import (
    DEFAULT_R_MIN,
    TierProfile,
    profile_tier,
    tune_tier,
)
from sglang_hicache_ext.tuning.ratio.quality_floor import quality_floor
from sglang_hicache_ext.tuning.ratio.server_probe import (
    CalibrationPrompt,
    full_prefill,
    fused,
    register,
)

TIERS = ("dram", "disk", "disk_throttled", "mooncake")
SERVED_FROM = {"dram": "host", "disk": "disk", "disk_throttled": "disk", "mooncake": "mooncake"}
MOONCAKE_SEGMENT_BYTES = 2 * 1024**3  # lent by the separate process: every prompt's chunks


@contextmanager
def tier_server(tier: str, read_bytes_per_s: int) -> Iterator[ServerConfig]:
    folder = Path(tempfile.mkdtemp(prefix="bench-tiers-"))
    settings: dict[str, Any] = {}
    with ExitStack() as stack:
        if tier.startswith("disk"):
            settings = {"chunk_disk_dir": str(folder / "chunks"), "chunk_store_bytes": 1}
        if tier == "disk_throttled":
            settings["chunk_disk_read_bytes_per_s"] = read_bytes_per_s
        if tier == "mooncake":
            master = stack.enter_context(
                running_master(folder / "mooncake.log", MOONCAKE_SEGMENT_BYTES)
            )
            settings = {
                "chunk_store_bytes": 1,
                "chunk_mooncake_master": master.address,
                "chunk_mooncake_segment_bytes": 0,
            }
        path = folder / "hicache_ext.json"
        path.write_text(json.dumps(settings))
        env = {"SGLANG_HICACHE_EXT_CONFIG": str(path)}
        yield stack.enter_context(smollm2_server(f"tiers-{tier}", env=env))


def grid(r_min: float) -> list[float]:
    steps = round((1.0 - r_min) / 0.05)
    return [round(r_min + 0.05 * i, 2) for i in range(steps + 1)]


def _median_run(url: str, prompts: list[CalibrationPrompt], tier: str, **options: Any) -> dict:
    runs = [fused(url, p.text, tier, **options) for p in prompts]
    out: dict[str, Any] = {"ttft_s": statistics.median(r.ttft_s for r in runs)}
    loads = [r.info["load"] for r in runs if "load" in r.info]
    if loads:
        out["load"] = {
            k: statistics.median(load[k] for load in loads) for k in loads[0] if k != "overlapped"
        }
    return out


def interleaved(
    url: str, prompts: list[CalibrationPrompt], tier: str, ratios: list[float], rounds: int
) -> dict[float, float]:
    """Median TTFT per ratio, the ratios measured alternately on every prompt, `rounds` times."""
    times: dict[float, list[float]] = {ratio: [] for ratio in ratios}
    for _ in range(rounds):
        for prompt in prompts:
            for ratio in ratios:
                times[ratio].append(fused(url, prompt.text, tier, recompute_ratio=ratio).ttft_s)
    return {ratio: statistics.median(values) for ratio, values in times.items()}


def measure_tier(
    tier: str, prompts: list[CalibrationPrompt], r_min: float, read_bytes_per_s: int, rounds: int
) -> tuple[dict[str, Any], TierProfile]:
    served_from = SERVED_FROM[tier]
    with tier_server(tier, read_bytes_per_s) as config:
        url = config.url
        register(url, prompts)
        full = statistics.median(full_prefill(url, p.text)[0] for p in prompts)
        profile = profile_tier(url, MODEL, served_from, prompts)
        search = tune_tier(url, prompts, profile, r_min)
        curve = {}
        for ratio in tqdm(grid(r_min), desc=f"{tier} grid", unit="ratio", disable=None):
            curve[ratio] = _median_run(url, prompts, served_from, recompute_ratio=ratio)
        best_ratio = min(curve, key=lambda r: curve[r]["ttft_s"])
        tuned_ratio = round(search.ratio, 4)
        confirm = interleaved(url, prompts, served_from, sorted({tuned_ratio, best_ratio}), rounds)
        overlap = {}
        if tier.startswith("disk"):  # streamed tiers (a Mooncake chunk is fetched whole)
            for ratio in sorted({r_min, round(search.ratio, 2)}):
                on = _median_run(url, prompts, served_from, recompute_ratio=ratio)
                off = _median_run(
                    url, prompts, served_from, recompute_ratio=ratio, overlap_loads=False
                )
                transfer = off["load"]["read_s"]
                overlap[str(ratio)] = {
                    "ttft_overlapped_s": on["ttft_s"],
                    "ttft_sequential_s": off["ttft_s"],
                    "transfer_s": transfer,
                    "exposed_transfer_s": on["load"]["wait_s"],
                    "hidden_fraction": (off["ttft_s"] - on["ttft_s"]) / transfer
                    if transfer
                    else None,
                    "hidden_fraction_by_wait": 1 - on["load"]["wait_s"] / on["load"]["read_s"],
                }
    at_floor = curve[grid(r_min)[0]]
    report = {
        "served_from": served_from,
        "read_bytes_per_s": read_bytes_per_s if tier == "disk_throttled" else None,
        "full_prefill_ttft_s": full,
        "profile": profile.to_json(),
        "search": {
            "ratio": search.ratio,
            "prior": search.prior,
            "bounds": search.bounds,
            "probes": [p._asdict() for p in search.probes],
        },
        "ttft_by_ratio": {str(r): v for r, v in curve.items()},
        "best_fixed": {"ratio": best_ratio, "ttft_s": confirm[best_ratio]},
        "tuned": {"ratio": tuned_ratio, "ttft_s": confirm[tuned_ratio]},
        "tuned_vs_best_fixed": confirm[tuned_ratio] / confirm[best_ratio],
        "confirm_runs": rounds * len(prompts),
        "r_min_vs_full_prefill": at_floor["ttft_s"] / full,
        "sparse_bytes_at_r_min": at_floor.get("load"),
        "overlap": overlap,
    }
    return report, profile


def main() -> int:
    parser = server_benchmark_parser(__doc__, "fusion_tiers.json")
    parser.set_defaults(repeats=3)
    parser.add_argument("--min-tokens", type=int, default=3000)
    parser.add_argument("--r-min", type=float, help="default: the model's quality floor, else 0.15")
    parser.add_argument("--rounds", type=int, default=3, help="runs per prompt of the final check")
    parser.add_argument("--tiers", nargs="+", choices=TIERS, default=list(TIERS))
    parser.add_argument(
        "--throttle", type=int, help="disk_throttled read rate, B/s (default: from the disk tier)"
    )
    args = parser.parse_args()
    floor = quality_floor(MODEL)
    r_min = args.r_min or (floor.ratio if floor is not None and floor.ratio else DEFAULT_R_MIN)
    prompts = [
        CalibrationPrompt(tuple(docs), text)
        for docs, text in build_prompts(args.repeats, 6, args.min_tokens, smollm2_tokenizer())
    ]
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    results: dict[str, Any] = dict(previous.get("tiers", {}))
    throttle = args.throttle or (results.get("disk_throttled") or {}).get("read_bytes_per_s") or 0
    for tier in args.tiers:
        if tier == "disk_throttled" and not throttle:
            raise SystemExit("disk_throttled needs the disk tier first, or --throttle")
        results[tier], profile = measure_tier(tier, prompts, r_min, throttle, args.rounds)
        results[tier]["measured_on"] = date.today().isoformat()
        if tier == "disk" and not args.throttle:
            # The rate where loading a token costs what recomputing it does.
            throttle = int(profile.kv_bytes_per_token_layer / profile.costs.recompute_s)
        row = results[tier]
        print(
            f"{tier}: full {row['full_prefill_ttft_s']:.2f}s, r_min {r_min} "
            f"{row['r_min_vs_full_prefill']:.3f}x full, tuned r*={row['search']['ratio']:.3f} "
            f"(prior {row['search']['prior']:.3f}) {row['tuned_vs_best_fixed']:.3f}x best fixed "
            f"r={row['best_fixed']['ratio']}"
        )
    report = {
        "benchmark": "fusion_tiers",
        "model": MODEL,
        "prompts": len(prompts),
        "r_min": r_min,
        "ttft_method": "client latency of /generate with max_new_tokens=1, after /flush_cache",
        "tiers": {tier: results[tier] for tier in TIERS if tier in results},
    }
    write_json(args.out, report, indent=1)
    print(f"results: {args.out}; plot: {plot_fusion_tiers(args.out, args.out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
