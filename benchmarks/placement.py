"""EvicPress placement (codec and tier per context, by utility) against LRU with and without a
fixed codec, on a replayed RAG workload served by the CPU server.

Contexts: HotpotQA questions, each with its 10 paragraphs registered as chunks (SmolLM2-135M
server, KV as the server keeps it). Popularity: Zipf (`--skew`) over the contexts in a seeded
order; `--warmup` requests first (not measured: they fill the LRU, and are the recorded queries
the placement takes each context's frequency from), then `--requests` measured ones. Host memory
(`chunk_store_bytes`) holds `--dram-fraction` of every chunk's dense bytes; every chunk is also on
the local disk tier, throttled to the rate of `benchmarks/results/fusion_tiers.json`
(`disk_throttled`). One server per policy, one after the other:

  lru         dense chunks, host memory an LRU cache of the disk (chunks promoted when read);
  lru#int8    the same with every chunk stored int8 (host memory counts compressed bytes);
  lru#int4    the same, int4;
  evicpress   per context the (tier, codec) of EvicPress's greedy knapsack (Algorithm 1) over
              (alpha * quality - TTFT) * frequency, never below `--quality-floor`; host memory
              holds what the placement put there (`chunk_promote_on_read: false`);
  live        dense chunks and LRU during the warm-up, then the server's own placement round
              (`POST /hicache_ext/placement`: probes every chunk, places per chunk;
              `benchmarks/placement_live.py`); `live#int8`: chunks registered int8 (the disk
              keeps int8 rows), host memory holds int8 or int4 as the round places them.

Quality of a context under a codec is the profile of `fusion_retention_qwen_codecs.json`: token
F1 of Qwen2.5-0.5B's answer to the context's real question with the codec's chunks against its
answer with uncompressed chunks, both at r = 0.15 (SmolLM2 does not answer HotpotQA, so the
answers come from the model that can; the TTFTs from this server). The TTFTs the placement
plans with come from a profiling server (full and fused prefill per token, the disk's rate).
TTFT = client latency of /generate with max_new_tokens=1 after /flush_cache.

    python -m benchmarks.placement [--contexts 40] [--requests 80]
"""

from __future__ import annotations

import functools
import json
import random
import statistics
import tempfile
from collections import Counter
from datetime import date
from pathlib import Path
from typing import Any, NamedTuple

import requests
from tqdm import tqdm

from benchmarks.placement_live import place_live
from benchmarks.smollm2_server import (
    MODEL,
    RESULTS,
    server_benchmark_parser,
    smollm2_server,
    smollm2_tokenizer,
)
from sglang_hicache_ext.evaluation.answer_quality import f1_score
from sglang_hicache_ext.evaluation.hotpotqa import load_hotpotqa
from sglang_hicache_ext.tuning.placement.context_options import (
    ContextCosts,
    TierSpeed,
    context_profile,
)
from sglang_hicache_ext.tuning.placement.greedy import place
from sglang_hicache_ext.tuning.ratio.server_probe import timed_generate

POLICIES = ("lru", "lru#int8", "lru#int4", "evicpress", "live")
CODECS = ("none", "int8", "int4")
RATIO = 0.15
UNLIMITED = {"chunk_registrations_per_minute": 0}  # hundreds of chunks are registered at once
QUALITY_FILE = RESULTS / "fusion_retention_qwen_codecs.json"
QUALITY_SEED = 2026  # the question sample of fusion_retention


class Context(NamedTuple):
    qid: str
    documents: tuple[str, ...]
    prompt: str
    quality: dict[str, float]  # per codec


def load_contexts(count: int) -> list[Context]:
    rows = {row["qid"]: row["methods"] for row in json.loads(QUALITY_FILE.read_text())["rows"]}
    contexts = []
    for example in load_hotpotqa(len(rows), seed=QUALITY_SEED):
        methods = rows.get(example.qid)
        if methods is None:
            continue
        dense = methods[f"default@{RATIO}"]["answer"]
        quality = {"none": 1.0}
        for codec in CODECS[1:]:
            quality[codec] = f1_score(methods[f"default@{RATIO}#{codec}"]["answer"], dense)
        docs = list(example.documents)
        random.Random(example.qid).shuffle(docs)
        prompt = "Documents:\n" + "\n\n".join(docs) + f"\n\nQuestion: {example.question}\nAnswer:"
        contexts.append(Context(example.qid, tuple(example.documents), prompt, quality))
    return contexts[:count]


def zipf_trace(contexts: int, count: int, skew: float, seed: int) -> list[int]:
    rng = random.Random(seed)
    order = rng.sample(range(contexts), contexts)  # popularity rank -> context
    weights = [1.0 / (rank + 1) ** skew for rank in range(contexts)]
    return [order[i] for i in rng.choices(range(contexts), weights, k=count)]


def _settings_env(folder: Path, settings: dict[str, Any]) -> dict[str, str]:
    path = folder / "hicache_ext.json"
    path.write_text(json.dumps(settings))
    return {"SGLANG_HICACHE_EXT_CONFIG": str(path)}


def _register(url: str, text: str, codec: str) -> dict[str, Any]:
    body = {"text": text, "codec": None if codec == "none" else codec}
    response = requests.post(url + "/chunks", json=body, timeout=600)
    if response.status_code == 409:  # a paragraph of two contexts: the first codec stays
        response = requests.post(url + "/chunks", json={"text": text}, timeout=600)
    if response.status_code != 200:
        raise RuntimeError(f"/chunks answered {response.status_code}: {response.text}")
    return response.json()


def _request(url: str, prompt: str) -> tuple[float, dict[str, Any]]:
    seconds, meta = timed_generate(url, prompt, {"fusion": True, "fusion_recompute_ratio": RATIO})
    (info, *_) = meta.get("hicache_ext_fusion") or [{}]
    return seconds, {"prompt_tokens": meta["prompt_tokens"], **info}


def profile_costs(contexts: list[Context], throttle: int) -> dict[str, Any]:
    """The profiling server: host bytes per chunk token for each codec (the contexts after the
    sample, registered with it), full and fused prefill time per prompt token."""
    sample = contexts[:3]
    env = _settings_env(Path(tempfile.mkdtemp(prefix="bench-placement-profile-")), UNLIMITED)
    with smollm2_server("placement-profile", env=env) as config:
        listed = [_register(config.url, d, "none") for c in sample for d in c.documents]
        per_token = {}
        for codec, context in zip(CODECS[1:], contexts[3:], strict=False):
            infos = [_register(config.url, d, codec) for d in context.documents]
            per_token[codec] = sum(i["nbytes"] for i in infos) / sum(i["num_tokens"] for i in infos)
        full = [timed_generate(config.url, c.prompt, {})[0] for c in sample]
        fused = [_request(config.url, c.prompt) for c in sample]
    tokens = [info["prompt_tokens"] for _, info in fused]
    dense = sum(i["nbytes"] for i in listed) / sum(i["num_tokens"] for i in listed)
    return {
        "bytes_per_token": {"none": dense, **per_token},
        "dense_bytes_per_token": dense,
        "full_s_per_token": statistics.median(s / n for s, n in zip(full, tokens, strict=True)),
        "fused_s_per_token": statistics.median(
            s / n for (s, _), n in zip(fused, tokens, strict=True)
        ),
        "disk_bytes_per_s": throttle,
    }


def evicpress_plan(
    contexts: list[Context],
    warmup: list[int],
    sizes: dict[str, dict[str, int]],
    profile: dict[str, Any],
    budget: int,
    alpha: float,
    floor: float,
) -> dict[str, tuple[str | None, str]]:
    """(tier, codec) per context: frequencies from the warm-up (the recorded queries)."""
    counts = Counter(warmup)
    tiers = [TierSpeed("host", None), TierSpeed("disk", profile["disk_bytes_per_s"])]
    profiles = []
    for index, context in enumerate(contexts):
        tokens = sizes[context.qid]["tokens"]  # of its chunks: the prompt adds a few more
        costs = ContextCosts(
            stored_bytes={codec: sizes[context.qid][codec] for codec in CODECS},
            quality=context.quality,
            fused_s=profile["fused_s_per_token"] * tokens,
            full_s=profile["full_s_per_token"] * tokens,
        )
        frequency = (counts[index] + 0.1) / (len(warmup) + 0.1 * len(contexts))
        profiles.append(context_profile(context.qid, frequency, costs, tiers))
    placement = place(profiles, {"host": budget, "disk": 1 << 50}, alpha, floor)
    return {key: (option.tier, option.codec) for key, option in placement.chosen.items()}


def run_policy(
    policy: str,
    contexts: list[Context],
    trace: list[int],
    warmup: int,
    budget: int,
    throttle: int,
    plan: dict[str, tuple[str | None, str]] | None,
    plan_args: tuple[float, float] = (20.0, 0.9),
) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix=f"bench-placement-{policy.replace('#', '-')}-"))
    adaptive = policy.partition("#")[0] == "live"
    live = {"alpha": plan_args[0], "quality_floor": plan_args[1]} if adaptive else None
    settings = {
        "chunk_store_bytes": budget,
        "chunk_disk_dir": str(folder / "chunks"),
        "chunk_disk_read_bytes_per_s": throttle,
        "chunk_promote_on_read": plan is None,
        **UNLIMITED,
    }
    fixed = policy.partition("#")[2] or "none"
    codec_of = {c.qid: (plan[c.qid][1] if plan else fixed) for c in contexts}
    stored = [c for c in contexts if plan is None or plan[c.qid][0] is not None]
    if plan is not None:  # host-placed contexts registered last: host memory keeps them
        stored.sort(key=lambda c: plan[c.qid][0] == "host")
    else:
        stored = random.Random(7).sample(stored, len(stored))
    sizes: dict[str, int] = {}
    chunk_ids: dict[str, list[str]] = {}
    rows = []
    round_info = None
    with smollm2_server(f"placement-{policy}", env=_settings_env(folder, settings)) as config:
        for context in tqdm(stored, desc=f"{policy} register", unit="ctx", disable=None):
            infos = [_register(config.url, d, codec_of[context.qid]) for d in context.documents]
            sizes[context.qid] = sum(info["nbytes"] for info in infos)
            chunk_ids[context.qid] = [info["id"] for info in infos]
        for step, index in enumerate(tqdm(trace, desc=policy, unit="req", disable=None)):
            if step == warmup and live is not None:
                codec_of, round_info = place_live(config.url, chunk_ids, **live)
            context = contexts[index]
            seconds, info = _request(config.url, context.prompt)
            if step < warmup:
                continue
            fused = bool(info.get("fused"))
            rows.append(
                {
                    "qid": context.qid,
                    "ttft_s": seconds,
                    "fused": fused,
                    "chunks_by_tier": info.get("chunks_by_tier", {}),
                    "codec": codec_of[context.qid] if fused else "recomputed",
                    "quality": context.quality[codec_of[context.qid]] if fused else 1.0,
                }
            )
        stats = requests.get(config.url + "/chunks", timeout=60).json()["stats"]
    tiers = Counter()
    for row in rows:
        tiers.update(row["chunks_by_tier"])
    return {
        "mean_ttft_s": statistics.fmean(r["ttft_s"] for r in rows),
        "median_ttft_s": statistics.median(r["ttft_s"] for r in rows),
        "mean_quality": statistics.fmean(r["quality"] for r in rows),
        "chunk_hits_by_tier": dict(tiers),
        "host_bytes_used": stats["bytes_used"],
        "stored_bytes_by_context": sizes,
        "codecs": dict(Counter(codec_of[c.qid] for c in stored)),
        "recomputed_contexts": len(contexts) - len(stored),
        "placement_round": round_info,
        "requests": rows,
    }


def _adaptive(policy: str) -> bool:
    return policy == "evicpress" or policy.partition("#")[0] == "live"


def summarize(policies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each adaptive policy against the fixed policies within 1 quality point of it."""
    fixed = {k: v for k, v in policies.items() if not _adaptive(k)}
    summary = {}
    for name, ours in policies.items():
        if not _adaptive(name):
            continue
        near = {k: v for k, v in fixed.items() if v["mean_quality"] >= ours["mean_quality"] - 0.01}
        best = min(near, key=lambda k: near[k]["mean_ttft_s"]) if near else None
        summary[name] = {
            "best_fixed_within_1_point": best,
            "ttft_ratio_best_fixed_over_ours": None
            if best is None
            else near[best]["mean_ttft_s"] / ours["mean_ttft_s"],
            "ttft_ratio_by_policy": {
                k: v["mean_ttft_s"] / ours["mean_ttft_s"] for k, v in fixed.items()
            },
        }
    return summary


def main() -> int:
    parser = server_benchmark_parser(__doc__, "placement.json")
    parser.add_argument("--contexts", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of popularity")
    parser.add_argument("--dram-fraction", type=float, default=0.3)
    parser.add_argument(
        "--alpha", type=float, default=20.0, help="seconds of TTFT per unit quality"
    )
    parser.add_argument("--quality-floor", type=float, default=0.9)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    tiers = json.loads((RESULTS / "fusion_tiers.json").read_text())["tiers"]
    throttle = int(tiers["disk_throttled"]["read_bytes_per_s"])
    contexts = load_contexts(args.contexts)
    trace = zipf_trace(len(contexts), args.warmup + args.requests, args.skew, args.seed)
    profile = profile_costs(contexts, throttle)
    tokens = {c.qid: sum(_token_count(d) for d in c.documents) for c in contexts}
    dense_total = sum(tokens.values()) * profile["dense_bytes_per_token"]
    budget = int(args.dram_fraction * dense_total)
    results: dict[str, Any] = {}
    plan = evicpress_plan(
        contexts,
        trace[: args.warmup],
        _codec_sizes(contexts, tokens, profile),
        profile,
        budget,
        args.alpha,
        args.quality_floor,
    )
    for policy in args.policies.split(","):
        results[policy] = run_policy(
            policy,
            contexts,
            trace,
            args.warmup,
            budget,
            throttle,
            plan if policy == "evicpress" else None,
            (args.alpha, args.quality_floor),
        )
        print(
            policy,
            {k: results[policy][k] for k in ("mean_ttft_s", "mean_quality", "chunk_hits_by_tier")},
        )
        args.out.with_suffix(".partial.json").write_text(json.dumps(results) + "\n")
    report = {
        "benchmark": "placement",
        "date": date.today().isoformat(),
        "model": MODEL,
        "quality_profile": f"{QUALITY_FILE.name} (Qwen2.5-Coder-0.5B answers, r = {RATIO})",
        "contexts": len(contexts),
        "warmup": args.warmup,
        "requests": args.requests,
        "skew": args.skew,
        "dram_fraction": args.dram_fraction,
        "host_budget_bytes": budget,
        "dense_bytes_total": dense_total,
        "disk_read_bytes_per_s": throttle,
        "alpha": args.alpha,
        "quality_floor": args.quality_floor,
        "recompute_ratio": RATIO,
        "profile": profile,
        "quality_by_codec": {
            codec: statistics.fmean(c.quality[codec] for c in contexts) for codec in CODECS
        },
        "evicpress_plan": {qid: list(choice) for qid, choice in plan.items()},
        "policies": results,
        "summary": summarize(results),
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".partial.json").unlink(missing_ok=True)
    print(json.dumps(report["summary"], indent=1))
    return 0


@functools.cache
def _tokenizer() -> Any:
    return smollm2_tokenizer()


def _token_count(text: str) -> int:
    return len(_tokenizer().encode(text, add_special_tokens=False))


def _codec_sizes(
    contexts: list[Context], tokens: dict[str, int], profile: dict[str, Any]
) -> dict[str, dict[str, int]]:
    """Host bytes per context and codec, from the bytes per token the profiling server listed."""
    per_token = profile["bytes_per_token"]
    return {
        c.qid: {"tokens": tokens[c.qid]} | {k: int(tokens[c.qid] * per_token[k]) for k in CODECS}
        for c in contexts
    }


if __name__ == "__main__":
    raise SystemExit(main())
