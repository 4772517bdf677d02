"""`auto_chunks` under a stream of unique documents and pathological prompts, in one run.

SmolLM2-135M-Instruct on the CPU server, one server at a time, in `--rounds` rounds:

1. `auto_chunks` off (a server where nobody fuses): the first `--baseline` requests of the
   stream, each timed (client latency of /generate, one new token); in the first round also
   the pathological prompts.
2. `auto_chunks` and `fusion_by_default` on, `chunk_store_bytes` = `--store-mb`, a fresh server:
   the same first requests, every one of them new documents to keep. In the last round this
   server goes on with the whole stream, `--docs` unique HotpotQA paragraphs (their first ~200
   characters: ~45 tokens, above `auto_chunk_min_tokens`), `--per-request` per prompt, one
   request at a time. Every 25 requests: the server's resident memory (all its processes), the
   chunk bytes in host memory and the `auto_chunks` counts. Then the pathological prompts
   again, fused by default.

Why rounds: the same prompt's latency moves by 10-20 % between two servers started minutes
apart on this 2-core machine (0.25 s on ~1.9 s); alternating the two kinds of server and
comparing each prompt's median over rounds keeps that drift out of the ratio.

Reported: latency of the stream's first requests with and without `auto_chunks` (the cost of
capture when nothing is reused), RSS growth over the second half, the store's bytes against its
budget, pieces kept per minute against `auto_chunks_per_minute`, and each pathological prompt's
latency against fusion off: one token repeated to near the context, 700 one-line paragraphs
(SmolLM2's context holds 8,192 tokens) and paragraphs that differ by one character, each sent
cold (prefix tree flushed) three times.

    python -m benchmarks.auto_reuse_limits [--docs 10000 --per-request 20]
-> benchmarks/results/auto_reuse_limits.json, .png
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import requests
from tqdm import tqdm

from benchmarks.smollm2_server import RESULTS, report_header, smollm2_server, write_report
from sglang_hicache_ext.evaluation.hotpotqa import load_hotpotqa
from sglang_hicache_ext.sglang_ext.server.launcher import (
    flush_cache,
    group_rss_bytes,
    server_process_group,
)

REPEATS = 3


def unique_documents(count: int) -> list[str]:
    """The first `count` distinct paragraph openings of every question in one fixed order, so a
    shorter stream is the start of a longer one."""
    docs: dict[str, None] = {}
    for example in load_hotpotqa(7405, seed=41):
        for doc in example.documents:
            docs.setdefault(doc[:200].rsplit(" ", 1)[0], None)
        if len(docs) >= count:
            return list(docs)[:count]
    raise SystemExit(f"HotpotQA has {len(docs)} distinct paragraphs, fewer than {count}")


def timed(url: str, body: dict[str, Any]) -> float:
    began = time.perf_counter()
    response = requests.post(url + "/generate", json=body, timeout=1200)
    response.raise_for_status()
    return time.perf_counter() - began


def prompt_body(docs: list[str], **custom: Any) -> dict[str, Any]:
    text = "\n\n".join(docs) + "\n\nWhich of these is about a person?"
    return {"text": text, "sampling_params": {"max_new_tokens": 1, "custom_params": custom}}


def pathological(url: str, docs: list[str]) -> dict[str, dict[str, Any]]:
    token = requests.post(url + "/tokenize", json={"prompt": " the"}, timeout=30).json()["tokens"]
    lines = "\n".join(f"Line {i}: all quiet." for i in range(700))
    twins = [d for doc in docs[:6] for d in (doc, doc.replace(" ", "  ", 1))]
    return {
        "one_token_x7000": {
            "input_ids": token[-1:] * 7000,
            "sampling_params": {"max_new_tokens": 1},
        },
        "lines_x700": {"text": lines, "sampling_params": {"max_new_tokens": 1}},
        "one_word_twins": prompt_body(twins),
    }


def time_pathological(url: str, docs: list[str]) -> dict[str, float]:
    """Median latency of each prompt sent cold: the prefix tree flushed before every run (a
    repeated prompt would otherwise be a prefix-cache hit off, while fused KV never enters the
    tree); stored chunks stay."""
    bodies = pathological(url, docs)
    medians = {}
    for name, body in bodies.items():
        runs = []
        for _ in range(REPEATS):
            flush_cache(url)
            runs.append(timed(url, body))
        medians[name] = statistics.median(runs)
    return medians


def auto_stats(url: str) -> dict[str, Any]:
    state = requests.get(url + "/server_info", timeout=30).json()["internal_states"][0]
    ext = state["hicache_ext"]
    return {"auto": ext["auto_chunks"], "host_bytes": ext["chunks"]["bytes_used"]}


def settings_env(values: dict[str, Any]) -> dict[str, str]:
    path = Path(tempfile.mkdtemp(prefix="auto-limits-")) / "settings.json"
    path.write_text(json.dumps(values))
    return {"SGLANG_HICACHE_EXT_CONFIG": str(path)}


def plot(report: dict[str, Any], out: Path) -> Path:
    """The first prompts' latency per round with and without `auto_chunks`; the stream's
    latency, resident memory and chunk bytes as it goes."""
    import matplotlib.pyplot as plt

    from benchmarks.run_figures import save_run_figure

    figure, (rounds, stream) = plt.subplots(1, 2, figsize=(11, 4))
    labels, runs = [], []
    for i, (off, on) in enumerate(
        zip(report["latency_off_s"], report["latency_on_s"], strict=True)
    ):
        labels += [f"off {i + 1}", f"on {i + 1}"]
        runs += [off, on]
    rounds.boxplot(runs, tick_labels=labels)
    rounds.set(ylabel="latency (s)", title="First prompts, 20 new documents each, per round")
    stream.scatter(range(1, len(report["latency_stream_s"]) + 1), report["latency_stream_s"], s=4)
    stream.set(xlabel="request", ylabel="latency (s)", title="The stream, auto_chunks on")
    memory = stream.twinx()
    at = [s["requests"] for s in report["samples"]]
    memory.plot(at, [s["rss_bytes"] / 2**30 for s in report["samples"]], color="C1", label="RSS")
    memory.plot(
        at,
        [s["host_bytes"] / 2**30 * 10 for s in report["samples"]],
        color="C2",
        label="chunk bytes x10",
    )
    memory.set(ylabel="GiB")
    memory.set_ylim(bottom=0)
    memory.legend(loc="center right")
    return save_run_figure(figure, report, out)


def paired_ratio(on: list[list[float]], off: list[list[float]]) -> float:
    """Median over prompts of (median of its rounds with `auto_chunks`) / (median without)."""
    per_prompt = [
        statistics.median(on_runs) / statistics.median(off_runs)
        for on_runs, off_runs in zip(zip(*on, strict=True), zip(*off, strict=True), strict=True)
    ]
    return statistics.median(per_prompt)


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=10_000)
    parser.add_argument("--per-request", type=int, default=20)
    parser.add_argument("--baseline", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--store-mb", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS / "auto_reuse_limits.json")
    args = parser.parse_args()
    if args.rounds < 1 or args.baseline < 1:
        parser.error("--rounds and --baseline must be at least 1")
    docs = unique_documents(args.docs)
    batches = [docs[i : i + args.per_request] for i in range(0, len(docs), args.per_request)]
    first = batches[: args.baseline]
    budget = args.store_mb * 1024**2
    env = settings_env(
        {"auto_chunks": True, "fusion_by_default": True, "chunk_store_bytes": budget}
    )
    off_latency: list[list[float]] = []
    on_latency: list[list[float]] = []
    for round_ in range(args.rounds):
        with smollm2_server("limits-off", env=settings_env({})) as server:
            off_latency.append([timed(server.url, prompt_body(b)) for b in first])
            if round_ == 0:
                off_pathological = time_pathological(server.url, docs)
        if round_ < args.rounds - 1:
            with smollm2_server("limits-on", env=env) as server:
                on_latency.append([timed(server.url, prompt_body(b)) for b in first])
    samples, stream_latency = [], []
    with smollm2_server("limits-on", env=env) as server:
        group = server_process_group(server.port)
        began = time.monotonic()
        for i, batch in enumerate(tqdm(batches, desc="stream", disable=None)):
            stream_latency.append(timed(server.url, prompt_body(batch)))
            if i % 25 == 24 or i == len(batches) - 1:
                stats = auto_stats(server.url)
                samples.append(
                    {
                        "requests": i + 1,
                        "seconds": time.monotonic() - began,
                        "rss_bytes": group_rss_bytes(group),
                        **stats,
                    }
                )
        on_pathological = time_pathological(server.url, docs)
        final = auto_stats(server.url)
    on_latency.append(stream_latency[: args.baseline])
    half = samples[len(samples) // 2 :]
    captured = final["auto"]["captured"]
    minutes = samples[-1]["seconds"] / 60
    off_all = [t for run in off_latency for t in run]
    on_all = [t for run in on_latency for t in run]
    summary = {
        "documents": len(docs),
        "requests": len(batches),
        "rounds": args.rounds,
        "latency_first_requests_off_s": statistics.median(off_all),
        "latency_first_requests_on_s": statistics.median(on_all),
        "latency_ratio_on_off": statistics.median(on_all) / statistics.median(off_all),
        "latency_ratio_paired": paired_ratio(on_latency, off_latency),
        "latency_ratio_per_round": [
            statistics.median(on) / statistics.median(off)
            for on, off in zip(on_latency, off_latency, strict=True)
        ],
        "rss_second_half_growth_bytes": half[-1]["rss_bytes"] - half[0]["rss_bytes"],
        "rss_at_half_bytes": half[0]["rss_bytes"],
        "host_chunk_bytes_max": max(s["host_bytes"] for s in samples),
        "host_chunk_budget_bytes": budget,
        "captured": captured,
        "over_cap": final["auto"]["over_cap"],
        "captured_per_minute": captured / minutes,
        "cap_per_minute": final["auto"]["per_minute"],
        "pathological_on_s": on_pathological,
        "pathological_off_s": off_pathological,
        "pathological_ratio": {
            k: on_pathological[k] / off_pathological[k] for k in off_pathological
        },
    }
    report = {
        **report_header("benchmarks.auto_reuse_limits"),
        "summary": summary,
        "samples": samples,
        "latency_off_s": off_latency,
        "latency_on_s": on_latency,
        "latency_stream_s": stream_latency,
    }
    return write_report(report, args.out, plot, summary)


if __name__ == "__main__":
    raise SystemExit(main())
