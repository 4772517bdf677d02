"""Reuse from ordinary OpenAI traffic (`auto_chunks`): no POST /chunks, in one run.

SmolLM2-135M-Instruct on the CPU server, `auto_chunks` and `fusion_by_default` on,
`--enable-cache-report`. A corpus of `--corpus` HotpotQA paragraphs; `--requests` streamed chat
requests through the `openai` package, each with `--per-request` paragraphs drawn at random in
random order ("Document i. " labels, a question of the paragraphs' own example). Each prompt is
sent fused (the server's default: question_attention, r = 0.15) and then with
`{"fusion": false}`, one request at a time; TTFT is the first streamed token. Per request:
whether every document was seen before, how many document tokens the fused prefill matched to
stored chunks (the server's fusion counters around the request; edge loss = the rest), the
reused rows (`usage.prompt_tokens_details.cached_tokens` minus the prefix-cache hit), and
whether the fused answer equals fusion off's.

A second server then gets the same corpus registered explicitly (POST /chunks after the system
prompt and chat header, no auto_chunks) and the same fused requests: agreement with fusion off
for the same documents either way.

    python -m benchmarks.auto_reuse [--requests 200 --corpus 40 --per-request 8] [--no-registered]

`--no-registered` leaves the second server out (its agreement is then null): the reuse and the
TTFT figures come from the first server alone, in two thirds of the time.
-> benchmarks/results/auto_reuse.json and auto_reuse.png (`--plot-only` redraws the figure).
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import requests
from tqdm import tqdm

from benchmarks.smollm2_server import (
    RESULTS,
    report_header,
    smollm2_server,
    smollm2_tokenizer,
    write_report,
)
from examples.openai_rag import SYSTEM, Answer, ask
from sglang_hicache_ext.evaluation.hotpotqa import load_hotpotqa

FLAGS = ("--enable-cache-report",)


def corpus_of(size: int) -> tuple[list[str], dict[str, str]]:
    """`size` paragraphs of HotpotQA examples, and a question of each paragraph's example."""
    docs: list[str] = []
    questions: dict[str, str] = {}
    for example in load_hotpotqa(size, seed=31):
        for doc in example.documents[:2]:
            if len(docs) < size and doc not in questions:
                docs.append(doc)
                questions[doc] = example.question
    return docs, questions


def traffic_draws(
    corpus_size: int, per_request: int, requests: int
) -> tuple[list[list[str]], dict[str, str], dict[str, int]]:
    """The requests' documents (seeded draws from the corpus), a question per document and each
    document's SmolLM2 token count: the same traffic for every benchmark that replays it."""
    corpus, questions = corpus_of(corpus_size)
    tokenizer = smollm2_tokenizer()
    tokens = {d: len(tokenizer.encode(d, add_special_tokens=False)) for d in corpus}
    rng = random.Random(2026)
    draws = [rng.sample(corpus, per_request) for _ in range(requests)]
    return draws, questions, tokens


def fusion_counters(url: str) -> dict[str, int]:
    info = requests.get(url + "/server_info", timeout=30).json()["internal_states"][0]
    fusion = info["hicache_ext"]["fusion"] or {}
    return {k: int(fusion.get(k, 0)) for k in ("fused_requests", "chunk_tokens", "tokens_reused")}


def fusion_off_twin(documents: list[str], number: int) -> list[str]:
    """The documents of the fusion-off twin of fused prompt `number`: the first behind the number
    in brackets, so the twin reuses none of the fused prompt's own pages in the prefix tree
    (which hold it when it fell back), yet shares the pages every prompt shares before its
    documents (the chat header and the system prompt), as the fused prompt does. A number in
    the system prompt instead denied the twin that page, and the fused request alone computed
    16 fewer tokens."""
    return [f"({number}) {documents[0]}", *documents[1:]]


class Pair(NamedTuple):
    """A fused request and its fusion-off twin (None where not timed), the fusion counters
    around the fused one, and whether the twin went first."""

    fused: Answer
    off: Answer | None
    before: dict[str, int]
    after: dict[str, int]
    off_first: bool


def fused_and_twin(
    url: str, number: int, fused: Callable[[], Answer], off: Callable[[], Answer] | None
) -> Pair:
    """Pair `number`: `fused` sent between two reads of the fusion counters (the second waits
    for the pieces the fused prompt kept, so neither request pays for the other's capture) and
    `off`, its twin, first in every other pair: whatever the order of a pair costs either
    request (the state the one before left) falls on each side alike."""
    off_first = off is not None and number % 2 == 1
    twin = off() if off is not None and off_first else None
    before = fusion_counters(url)
    answer = fused()
    after = fusion_counters(url)
    if off is not None and not off_first:
        twin = off()
    return Pair(answer, twin, before, after, off_first)


def settings_file(values: dict[str, Any]) -> str:
    path = Path(tempfile.mkdtemp(prefix="auto-reuse-")) / "settings.json"
    path.write_text(json.dumps(values))
    return str(path)


def run_traffic(
    url: str, draws: list[list[str]], questions: dict[str, str], tokens: dict[str, int]
) -> list[dict[str, Any]]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    seen: set[str] = set()
    rows = []
    for docs in tqdm(draws, desc="requests", disable=None):
        question = questions[docs[0]]
        before = fusion_counters(url)
        fused = ask(client, "default", docs, question)
        after = fusion_counters(url)
        off = ask(client, "default", docs, question, fusion=False)
        rows.append(
            {
                "all_seen": all(d in seen for d in docs),
                "seen_docs": sum(d in seen for d in docs),
                "document_tokens": sum(tokens[d] for d in docs),
                "seen_document_tokens": sum(tokens[d] for d in docs if d in seen),
                "fused": after["fused_requests"] > before["fused_requests"],
                "chunk_tokens": after["chunk_tokens"] - before["chunk_tokens"],
                "reused_rows": after["tokens_reused"] - before["tokens_reused"],
                **answer_fields("fused", fused),
                **answer_fields("off", off),
            }
        )
        seen.update(docs)
    return rows


def answer_fields(name: str, answer: Answer) -> dict[str, Any]:
    return {
        f"{name}_answer": answer.text,
        f"{name}_ttft_s": answer.ttft_s,
        f"{name}_cached_tokens": answer.cached_tokens,
        "prompt_tokens": answer.prompt_tokens,
    }


def run_registered(
    url: str, corpus: list[str], draws: list[list[str]], questions: dict[str, str]
) -> list[str]:
    """The same fused requests on a server whose corpus was registered explicitly."""
    import openai

    prefix = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
    for doc in corpus:
        response = requests.post(url + "/chunks", json={"text": doc, "prefix": prefix}, timeout=300)
        response.raise_for_status()
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    return [
        ask(client, "default", docs, questions[docs[0]]).text
        for docs in tqdm(draws, desc="registered", disable=None)
    ]


def registered_answers(
    corpus: list[str], draws: list[list[str]], questions: dict[str, str]
) -> list[str]:
    """The fused answers of a second server, the corpus registered and auto_chunks off."""
    settings = {"fusion_by_default": True, "auto_chunks": False}
    env = {"SGLANG_HICACHE_EXT_CONFIG": settings_file(settings)}
    with smollm2_server("auto-reuse-registered", extra_args=FLAGS, env=env) as server:
        return run_registered(server.url, corpus, draws, questions)


def summarise(rows: list[dict[str, Any]], registered: list[str] | None) -> dict[str, Any]:
    later = [r for r in rows if r["all_seen"]]
    second = [r for r in rows if r["seen_docs"]]
    covered = sum(r["chunk_tokens"] for r in second) / max(
        1, sum(r["seen_document_tokens"] for r in second)
    )
    ratios = [r["fused_ttft_s"] / r["off_ttft_s"] for r in later]
    agree = [r["fused_answer"] == r["off_answer"] for r in rows]
    agree_registered = (
        None
        if registered is None
        else [a == r["off_answer"] for a, r in zip(registered, rows, strict=True)]
    )
    return {
        "requests": len(rows),
        "requests_all_seen": len(later),
        "seen_document_tokens_matched": covered,
        "edge_loss": 1 - covered,
        "median_ttft_all_seen_fused_s": statistics.median(r["fused_ttft_s"] for r in later),
        "median_ttft_all_seen_off_s": statistics.median(r["off_ttft_s"] for r in later),
        "ttft_ratio_median_of_medians": statistics.median(r["fused_ttft_s"] for r in later)
        / statistics.median(r["off_ttft_s"] for r in later),
        "ttft_ratio_median_per_request": statistics.median(ratios),
        "agreement_auto": sum(agree) / len(agree),
        "agreement_registered": None
        if agree_registered is None
        else sum(agree_registered) / len(agree_registered),
        "agreement_auto_all_seen": sum(r["fused_answer"] == r["off_answer"] for r in later)
        / len(later),
    }


def plot(report: dict[str, Any], out: Path) -> Path:
    """TTFT per request, fused and fusion off, in request order; the fused/off ratio's CDF over
    the requests whose documents were all seen before."""
    import matplotlib.pyplot as plt

    from benchmarks.run_figures import save_run_figure, ttft_ratio_cdf

    rows = report["rows"]
    figure, (timeline, cdf) = plt.subplots(1, 2, figsize=(11, 4))
    index = range(1, len(rows) + 1)
    timeline.scatter(index, [r["off_ttft_s"] for r in rows], s=8, label="fusion off")
    timeline.scatter(index, [r["fused_ttft_s"] for r in rows], s=8, label="fused (auto_chunks)")
    timeline.set(xlabel="request", ylabel="TTFT (s)", title="TTFT per request, in order")
    timeline.legend()
    ttft_ratio_cdf(cdf, [r["fused_ttft_s"] / r["off_ttft_s"] for r in rows if r["all_seen"]])
    cdf.axvline(0.45, linestyle="--", color="grey", label="0.45x")
    cdf.set_xlim(0, 1.5)
    cdf.set(title="Requests whose documents were all seen before")
    cdf.legend()
    return save_run_figure(figure, report, out, "auto_chunks on ")


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--corpus", type=int, default=40)
    parser.add_argument("--per-request", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS / "auto_reuse.json")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from --out")
    parser.add_argument(
        "--no-registered", action="store_true", help="leave out the registered-corpus server"
    )
    args = parser.parse_args()
    if args.plot_only:
        print(plot(json.loads(args.out.read_text()), args.out.with_suffix(".png")))
        return 0
    draws, questions, tokens = traffic_draws(args.corpus, args.per_request, args.requests)
    corpus = list(tokens)
    auto = settings_file({"auto_chunks": True, "fusion_by_default": True})
    env = {"SGLANG_HICACHE_EXT_CONFIG": auto}
    with smollm2_server("auto-reuse", extra_args=FLAGS, env=env) as server:
        rows = run_traffic(server.url, draws, questions, tokens)
        auto_stats = requests.get(server.url + "/server_info", timeout=30).json()
    registered = None if args.no_registered else registered_answers(corpus, draws, questions)
    summary = summarise(rows, registered)
    report = {
        **report_header("benchmarks.auto_reuse"),
        "summary": summary,
        "auto_chunks": auto_stats["internal_states"][0]["hicache_ext"]["auto_chunks"],
        "rows": rows,
        "registered_answers": registered,
    }
    return write_report(report, args.out, plot, summary)


if __name__ == "__main__":
    raise SystemExit(main())
