"""Documents reused across servers behind SGLang's router: the local cluster, with and without
the shared chunk tier, in one run.

`hicache-ext-cluster`'s components (`sglang_ext/tools/cluster.py`): a Mooncake master and a store
process, `--servers` SmolLM2-135M servers (one core each) with `auto_chunks` and
`fusion_by_default`, and `smg` in front with the consistent-hashing policy, each request's routing
key (`x-smg-routing-key`) its own number, so that requests for the same document land on either
worker. A corpus of `--corpus` HotpotQA paragraphs; `--requests` streamed chat requests through
the router (the `openai` package), each with `--per-request` paragraphs drawn at random, sent
fused and then with `{"fusion": false}` (same routing key: same worker). Per request: the worker
that served it (its fusion counters moved), the document tokens seen before anywhere in the
cluster and only on the other worker, the tokens the fused prefill matched to stored chunks,
TTFT (first streamed token) of both.

`--ratio` pins the recompute ratio (the server's `fusion_recompute_ratio`; default: the server's
own `"auto"`). After the sequential traffic, `--concurrent` requests (the same draws again, fused)
go through the router, `--concurrency` at a time: errors, TTFT and the prompt tokens the servers
report cached (`usage.prompt_tokens_details.cached_tokens`).

At `--kill-at` (a share of the requests) worker 0 is killed with SIGKILL; the traffic goes on
(a failed request is counted with its time since the kill and sent again after 0.5 s); at
`--restart-at` it is started again on its port and the traffic goes on, now to both. Then a
second cluster without the shared tier (per-server tiers: `--no-shared-tier`) gets the same
requests up to the kill: the share reused and TTFT side by side.

    python -m benchmarks.cluster_reuse [--requests 48 --corpus 16 --per-request 4 --ratio 0.15]
-> benchmarks/results/cluster_reuse.json (+ .png).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests
from tqdm import tqdm

from benchmarks.auto_reuse import traffic_draws
from benchmarks.smollm2_server import RESULTS, report_header, smollm2_path, write_report
from examples.openai_rag import Answer, ask
from sglang_hicache_ext.sglang_ext.chunk_fusion.auto_capture import OUTCOMES
from sglang_hicache_ext.sglang_ext.server.ports import free_port
from sglang_hicache_ext.sglang_ext.tools.cluster import ClusterSpec, LocalCluster

# No shadow checks: one runs on a server's idle time after its fused answer, while the next
# request may be on the other server, and would move the counters that say who served what.
SETTINGS = {
    "auto_chunks": True,
    "auto_chunks_per_minute": 600,
    "fusion_by_default": True,
    "fusion_shadow_rate": 0.0,
}
ROUTING_KEY = "x-smg-routing-key"


def _counters(cluster: LocalCluster) -> dict[int, dict[str, int]]:
    """Per live worker: its fusion counters, and `asked`, a count that moves with every request
    that asks for fusion (fused, fallen back, or its pieces looked at by auto_chunks): the
    worker whose `asked` moved served the request."""
    found = {}
    for i, config in enumerate(cluster.configs):
        if cluster.processes[i].poll() is not None:
            continue
        with contextlib.suppress(requests.RequestException):  # starting, or just killed
            info = requests.get(config.url + "/server_info", timeout=30).json()
            fusion = info["internal_states"][0]["hicache_ext"]["fusion"] or {}
            counts = {
                k: int(fusion.get(k, 0))
                for k in ("fused_requests", "chunk_tokens", "tokens_reused")
            }
            fallbacks = sum(int(v) for k, v in fusion.items() if k.startswith("fallback_"))
            # A first sight is neither fused nor a fallback, but its pieces are looked at.
            auto = info["internal_states"][0]["hicache_ext"].get("auto_chunks") or {}
            looked_at = sum(int(auto.get(outcome, 0)) for outcome in OUTCOMES)
            found[i] = {**counts, "asked": counts["fused_requests"] + fallbacks + looked_at}
    return found


def _served_by(before: dict[int, dict[str, int]], after: dict[int, dict[str, int]]) -> int | None:
    """The worker that fused the request; for a first sight (nothing fused), the one whose
    `asked` moved most (a capture's counts can land a moment after its answer, on the worker
    that served the request before)."""
    both = [i for i in after if i in before]
    fused = [i for i in both if after[i]["fused_requests"] > before[i]["fused_requests"]]
    if len(fused) == 1:
        return fused[0]
    moved = sorted(both, key=lambda i: after[i]["asked"] - before[i]["asked"], reverse=True)
    if not moved or after[moved[0]]["asked"] == before[moved[0]]["asked"]:
        return None
    return moved[0]


def _ask_until_answered(
    client: Any, model: str, docs: list[str], question: str, key: str, errors: list[float], since: float,
    **custom: object,
) -> Answer:  # fmt: skip
    for _ in range(120):
        try:
            return ask(client, model, docs, question, headers={ROUTING_KEY: key}, **custom)
        except Exception:  # noqa: BLE001 - any failure the client sees is what is counted
            errors.append(time.monotonic() - since)
            time.sleep(0.5)
    raise RuntimeError("no answer through the router for a minute")


def run_traffic(
    cluster: LocalCluster,
    draws: list[list[str]],
    questions: dict[str, str],
    tokens: dict[str, int],
    kill_at: int | None,
    restart_at: int | None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    import openai

    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0)
    seen_on: dict[str, set[int]] = {}  # document -> workers that computed or reused it
    rows = []
    events: dict[str, Any] = {"errors_after_kill_s": [], "errors_other": []}
    killed_at = time.monotonic()
    for n, docs in enumerate(tqdm(draws, desc="requests", disable=None)):
        if n == kill_at:
            cluster.kill_server(0)
            killed_at = time.monotonic()
            events["killed_at_request"] = n
        if n == restart_at:
            began = time.monotonic()
            cluster.restart_server(0)
            events["restart_s"] = time.monotonic() - began
            time.sleep(2.5)  # two health checks of the router's: it routes there again
            events["restarted_at_request"] = n
        after_kill = kill_at is not None and n >= kill_at and (restart_at is None or n < restart_at)
        errors = events["errors_after_kill_s"] if after_kill else events["errors_other"]
        key = f"request-{n}"
        question = questions[docs[0]]
        before = _counters(cluster)
        fused = _ask_until_answered(
            client, cluster.model_name, docs, question, key, errors, killed_at
        )
        after = _counters(cluster)
        worker = _served_by(before, after)
        off = _ask_until_answered(
            client, cluster.model_name, docs, question, key, errors, killed_at, fusion=False
        )
        delta = (
            {k: after[worker][k] - before[worker][k] for k in after[worker]}
            if worker is not None
            else {}
        )
        rows.append(
            {
                "request": n,
                "worker": worker,
                "all_seen": all(d in seen_on for d in docs),
                "document_tokens": sum(tokens[d] for d in docs),
                "seen_document_tokens": sum(tokens[d] for d in docs if d in seen_on),
                # seen before, but never by the worker that serves this request
                "seen_elsewhere_tokens": sum(
                    tokens[d] for d in docs if d in seen_on and worker not in seen_on[d]
                ),
                "chunk_tokens": delta.get("chunk_tokens", 0),
                "reused_rows": delta.get("tokens_reused", 0),
                "fused_ttft_s": fused.ttft_s,
                "off_ttft_s": off.ttft_s,
                "fused_answer": fused.text,
                "off_answer": off.text,
                "fused_cached_tokens": fused.cached_tokens,
                "prompt_tokens": fused.prompt_tokens,
            }
        )
        for d in docs:
            seen_on.setdefault(d, set()).add(worker if worker is not None else -1)
    return rows, events


def run_concurrent(
    cluster: LocalCluster, draws: list[list[str]], questions: dict[str, str], concurrency: int,
    sequential: list[dict[str, Any]],
) -> dict[str, Any]:  # fmt: skip
    """The draws again, fused, `concurrency` at a time through the router (distinct routing keys:
    both workers busy at once). Every document was seen in the sequential phase."""
    import openai

    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0)

    def one(n: int) -> Answer | str:
        key = {ROUTING_KEY: f"concurrent-{n}"}
        try:
            return ask(client, cluster.model_name, draws[n], questions[draws[n][0]], headers=key)
        except Exception as error:  # noqa: BLE001 - every failure the client sees is counted
            return f"{type(error).__name__}: {error}"

    began = time.monotonic()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        answers = list(pool.map(one, range(len(draws))))
    ok = {n: a for n, a in enumerate(answers) if isinstance(a, Answer)}
    # Compared where the sequential phase fused it too (all its documents seen then).
    comparable = [n for n in ok if sequential[n]["all_seen"]]
    return {
        "requests": len(draws),
        "concurrency": concurrency,
        "errors": [a for a in answers if not isinstance(a, Answer)],
        "wall_s": time.monotonic() - began,
        "median_ttft_s": statistics.median(a.ttft_s for a in ok.values()) if ok else None,
        # cached_tokens also counts the chat template's shared prefix
        "cached_tokens": sum(a.cached_tokens or 0 for a in ok.values()),
        "prompt_tokens": sum(a.prompt_tokens or 0 for a in ok.values()),
        "same_answer_as_sequential": [
            sum(ok[n].text == sequential[n]["fused_answer"] for n in comparable),
            len(comparable),
        ],
    }


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def share(subset: list[dict[str, Any]], seen_key: str) -> float | None:
        # A document seen for the first time has nothing stored to match: every matched chunk
        # token is a seen document's.
        seen = sum(r[seen_key] for r in subset)
        return sum(r["chunk_tokens"] for r in subset) / seen if seen else None

    later = [r for r in rows if r["all_seen"]]
    summary: dict[str, Any] = {
        "requests": len(rows),
        "requests_all_seen": len(later),
        "seen_document_tokens_matched": share(
            [r for r in rows if r["seen_document_tokens"]], "seen_document_tokens"
        ),
        "per_worker": {},
    }
    if later:
        fused = statistics.median(r["fused_ttft_s"] for r in later)
        off = statistics.median(r["off_ttft_s"] for r in later)
        summary.update(
            median_ttft_all_seen_fused_s=fused,
            median_ttft_all_seen_off_s=off,
            ttft_ratio_all_seen=fused / off,
            ttft_ratio_median_per_request=statistics.median(
                r["fused_ttft_s"] / r["off_ttft_s"] for r in later
            ),
        )
    for worker in sorted({r["worker"] for r in rows if r["worker"] is not None}):
        mine = [r for r in rows if r["worker"] == worker]
        crossed = [
            r
            for r in mine
            if r["seen_elsewhere_tokens"]
            and r["seen_elsewhere_tokens"] == r["seen_document_tokens"]
        ]
        summary["per_worker"][str(worker)] = {
            "requests": len(mine),
            "seen_document_tokens_matched": share(
                [r for r in mine if r["seen_document_tokens"]], "seen_document_tokens"
            ),
            # requests whose seen documents were all seen only by the other worker
            "requests_seen_only_elsewhere": len(crossed),
            "seen_elsewhere_tokens_matched": share(crossed, "seen_elsewhere_tokens"),
        }
    summary["agreement_with_fusion_off"] = sum(
        r["fused_answer"] == r["off_answer"] for r in rows
    ) / len(rows)
    return summary


def run_cluster(
    args: argparse.Namespace, shared: bool, draws: list[list[str]], questions: dict[str, str],
    tokens: dict[str, int], kill_at: int | None, restart_at: int | None,
) -> dict[str, Any]:  # fmt: skip
    settings = dict(SETTINGS)
    if args.ratio is not None:
        settings["fusion_recompute_ratio"] = args.ratio
    spec = ClusterSpec(
        model_path=str(smollm2_path()),
        servers=args.servers,
        port=free_port(),
        policy="consistent_hashing",
        settings=settings,
        server_args=("--enable-cache-report",),
        max_total_tokens=20_000,
        shared_tier=shared,
        store_bytes=1 << 30,
    )
    cluster = LocalCluster(spec)
    began = time.monotonic()
    try:
        cluster.start()
        start_s = time.monotonic() - began
        rows, events = run_traffic(cluster, draws, questions, tokens, kill_at, restart_at)
        concurrent = (
            run_concurrent(cluster, draws[: args.concurrent], questions, args.concurrency, rows)
            if args.concurrent and shared
            else None
        )
        states = {}
        for i, config in enumerate(cluster.configs):
            info = requests.get(config.url + "/server_info", timeout=30).json()
            chunks = info["internal_states"][0]["hicache_ext"]["chunks"]
            states[str(i)] = {
                k: chunks.get(k) for k in ("found_in_shared_tier", "hits_by_tier", "mooncake")
            }
    finally:
        cluster.stop()
    # Chat requests the router answered with an error (its own log; ANSI colours removed).
    router_log = re.sub(
        r"\x1b\[[0-9;]*m", "", (cluster.log_dir / "router.log").read_text("utf-8", "replace")
    )
    events["router_chat_errors"] = len(
        re.findall(r"path=/v1/chat/completions[^\n]*status_code=(?!200)\d+", router_log)
    )
    return {
        "shared_tier": shared,
        "start_s": start_s,
        "events": events,
        "summary": summarise(rows),
        "concurrent": concurrent,
        "servers": states,
        "log_dir": str(cluster.log_dir),
        "rows": rows,
    }


def plot(report: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.plots import save_figure

    figure, (timeline, bars) = plt.subplots(1, 2, figsize=(11, 4))
    shared = report["shared"]
    series = [(f"fused, worker {w}", "fused_ttft_s", str(w), m) for w, m in ((0, "o"), (1, "s"))]
    for label, key, worker, marker in [*series, ("fusion off", "off_ttft_s", None, ".")]:
        rows = [r for r in shared["rows"] if worker is None or str(r["worker"]) == worker]
        xs, ys = [r["request"] for r in rows], [r[key] for r in rows]
        timeline.scatter(xs, ys, s=10, marker=marker, label=label)
    for name in ("killed_at_request", "restarted_at_request"):
        if name in shared["events"]:
            timeline.axvline(shared["events"][name], linestyle="--", color="black")
    timeline.set(xlabel="request", ylabel="TTFT (s)", title="Shared tier: TTFT (kill, restart)")
    timeline.legend(fontsize=7)
    reused = {
        f"{name}\nworker {worker}": figures["seen_document_tokens_matched"] or 0
        for name in ("shared", "per_server")
        for worker, figures in report[name]["summary"]["per_worker"].items()
    }
    bars.bar(list(reused), list(reused.values()))
    bars.axhline(0.9, linestyle="--", color="grey")
    bars.set(ylabel="seen-document tokens reused", ylim=(0, 1.05), title="Reuse per worker")
    return save_figure(figure, report["command"], out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--corpus", type=int, default=16)
    parser.add_argument("--per-request", type=int, default=4)
    parser.add_argument("--kill-at", type=float, default=0.5)
    parser.add_argument("--restart-at", type=float, default=0.75)
    parser.add_argument(
        "--ratio", type=float, default=None, help="fusion_recompute_ratio (default: auto)"
    )
    parser.add_argument("--concurrent", type=int, default=24, help="0: no concurrent phase")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS / "cluster_reuse.json")
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args()
    if args.plot_only:
        print(plot(json.loads(args.out.read_text()), args.out.with_suffix(".png")))
        return 0
    draws, questions, tokens = traffic_draws(args.corpus, args.per_request, args.requests)
    kill_at, restart_at = int(args.kill_at * args.requests), int(args.restart_at * args.requests)
    shared = run_cluster(args, True, draws, questions, tokens, kill_at, restart_at)
    per_server = run_cluster(args, False, draws[:kill_at], questions, tokens, None, None)
    report = {
        **report_header("benchmarks.cluster_reuse"),
        "recompute_ratio": "auto" if args.ratio is None else args.ratio,
        "shared": shared,
        "per_server": per_server,
    }
    keys = ("start_s", "events", "summary", "concurrent")
    brief = {k: {key: v[key] for key in keys} for k, v in report.items() if isinstance(v, dict)}
    return write_report(report, args.out, plot, brief)


if __name__ == "__main__":
    raise SystemExit(main())
