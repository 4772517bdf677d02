"""Concurrent mixed traffic against a real server: no crash, outputs equal to one-by-one runs.

The server (the session's `chunked_prefill_server`, tests/conftest.py) prefills in rounds of
128 tokens, so long prompts are split across chunked-prefill rounds and share batches with
fused requests (the shape that crashed the scheduler: a split normal request planned from its
whole prompt wrote more K/V rows than its round allocated).
Traffic mixes fused requests with every selector, fused prompts split across rounds, fused
requests with logprobs, fused requests whose decode attends only their kept rows (decode-time
eviction), normal long prompts with and without a shared system prefix, logprobs,
streaming, and streams the client drops midway, and prompts at the server's ratio matched below
the break-even. Also here, on the same server: fused logprobs equal to the normal prefill's at
r = 1 (a ~1.5K-token fused prompt over 12 rounds: tests/test_server_long_fused_prompt.py).

`HICACHE_EXT_CONCURRENCY_ROUNDS=N` repeats the concurrent phase N times against the same
one-by-one reference (the issue's "10 runs in a row": N=10).
"""

from __future__ import annotations

import json
import os
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests

from sglang_hicache_ext.evaluation.hotpotqa import load_hotpotqa
from sglang_hicache_ext.fusion.selectors import SELECTORS
from sglang_hicache_ext.sglang_ext.server.launcher import ServerConfig
from tests.conftest import SHADOW_QUEUE

pytestmark = pytest.mark.server

ROUNDS = int(os.environ.get("HICACHE_EXT_CONCURRENCY_ROUNDS", "1"))
FUSED_SELECTORS = sorted(s for s in SELECTORS if s != "full") + ["full"]
RATIOS = {"reuse": 0.0, "full": 1.0}


@dataclass(frozen=True)
class Job:
    """One request of the mix; `expect` is what its fusion report must say."""

    name: str
    text: str
    max_new_tokens: int = 6
    custom: dict[str, Any] = field(default_factory=dict)
    logprobs: bool = False
    stream: bool = False
    abort: bool = False  # streamed, and the client hangs up after the first event
    # "fused", "normal", or the fallback reasons its fusion report may give ("a|b").
    expect: str = "normal"

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "text": self.text,
            "sampling_params": {
                "max_new_tokens": self.max_new_tokens,
                "temperature": 0,
                "custom_params": self.custom,
            },
        }
        if self.logprobs:
            body.update(return_logprob=True, logprob_start_len=0)
        if self.stream:
            body["stream"] = True
        return body

    def key(self) -> str:
        """Requests with the same key are the same request."""
        return json.dumps(self.body(), sort_keys=True)


@dataclass(frozen=True)
class Outcome:
    output_ids: tuple[int, ...]
    fusion: tuple[dict[str, Any], ...]
    input_logprobs: int  # how many input-token logprobs came back


def _short_documents(tokenizer: Any, count: int, max_tokens: int) -> list[str]:
    """HotpotQA paragraphs cut to whole sentences within `max_tokens`."""
    documents: list[str] = []
    for example in load_hotpotqa(40, seed=11):
        for doc in example.documents:
            kept = ""
            for sentence in doc.split(". "):
                candidate = f"{kept}{sentence}. " if kept else f"{sentence}. "
                if len(tokenizer.encode(candidate, add_special_tokens=False)) > max_tokens:
                    break
                kept = candidate
            if len(tokenizer.encode(kept, add_special_tokens=False)) >= 40:
                documents.append(kept.strip())
            if len(documents) == count:
                return documents
    raise AssertionError("not enough short paragraphs")


def _fused(selector: str) -> dict[str, Any]:
    return {
        "fusion": True,
        "fusion_selector": selector,
        "fusion_recompute_ratio": RATIOS.get(selector, 0.15),
    }


@pytest.fixture(scope="module")
def jobs(chunked_prefill_server: ServerConfig, tiny_smollm2_path: Path) -> list[Job]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_smollm2_path))
    docs = _short_documents(tokenizer, 12, max_tokens=70)
    for doc in docs:
        response = requests.post(
            chunked_prefill_server.url + "/chunks", json={"text": doc}, timeout=120
        )
        assert response.status_code == 200, response.text
    long_text = " ".join(load_hotpotqa(6, seed=5)[i].documents[0] for i in range(6))
    system = "System: answer from the notes, in one short phrase. " * 8
    rng = random.Random(3)
    mix: list[Job] = []
    # Fused, one chunk each (prompt < 128 tokens: one round), every selector; 16 requests, the
    # last 7 the same as the first 7 (identical requests in one batch, one reference each).
    for i in range(16):
        j = i % len(FUSED_SELECTORS)
        selector = FUSED_SELECTORS[j]
        mix.append(
            Job(
                f"fused-{selector}-{i}",
                f"Note:\n{docs[j % 6]}\nQ{j}: what is it about?\nA:",
                custom=_fused(selector),
                expect="fused",
            )
        )
    # Fused, the prompt spanning two rounds (three chunks): computed whole in its first round.
    for i in range(4):
        text = (
            f"Notes {i}:\n{docs[6 + i]}\n\n{docs[(7 + i) % 12]}\n\n{docs[i]}\nWhich is older?\nA:"
        )
        mix.append(Job(f"fused-split-{i}", text, custom=_fused("a3"), expect="fused"))
    # Fused with input logprobs from the first token: every token is computed (exact).
    for i in range(4):
        mix.append(
            Job(
                f"fused-logprobs-{i}",
                f"Source {i}:\n{docs[6 + i]}\nSummary:",
                custom=_fused("cacheblend"),
                logprobs=True,
                expect="fused",
            )
        )
    # Normal long prompts (split into ~6 rounds), half behind a shared system prefix: 6 prompts,
    # each sent twice.
    words = long_text.split()
    starts = [rng.randrange(0, len(words) - 420) for _ in range(6)]
    for i in range(12):
        body = " ".join(words[starts[i % 6] : starts[i % 6] + 400])
        prefix = system if i % 2 else f"Request {i % 6}. "
        mix.append(Job(f"normal-long-{i}", f"{prefix}{body}\nIn short:"))
    # Fused at the server's ratio ("auto") but mostly new text: the normal prefill, split into
    # rounds (below_break_even, then prefix_cached once the rounds are past the chunk).
    for i in range(2):
        body = " ".join(words[starts[i] : starts[i] + 300])
        mix.append(
            Job(
                f"below-break-even-{i}",
                f"Note:\n{docs[11 - i]}\n\n{body}\nQ: which?\nA:",
                custom={"fusion": True},
                expect="below_break_even|prefix_cached",
            )
        )
    # Normal with input logprobs.
    for i in range(4):
        mix.append(
            Job(f"normal-logprobs-{i}", f"Log {i}: {docs[i]} {docs[i + 1]}\nNext:", logprobs=True)
        )
    # Streaming, fused and normal.
    for i in range(2):
        mix.append(
            Job(
                f"stream-fused-{i}",
                f"Note:\n{docs[2 + i]}\nStream {i}: who?\nA:",
                custom=_fused("a3"),
                stream=True,
                expect="fused",
            )
        )
        mix.append(Job(f"stream-normal-{i}", f"Stream {i}. {long_text[:1500]}\nSo:", stream=True))
    # Fused with decode-time eviction (a quarter of the prompt kept per layer and head), one
    # round and split, decoding in the same batches as requests that attend every row.
    for i in range(4):
        j = i % 2  # two prompts, each sent twice
        text = f"Files {j}:\n{docs[9]}\n\n{docs[10]}\nWhich came first?\nA:"
        text = text if j else f"Note:\n{docs[8]}\nQ: when?\nA:"
        evict = {**_fused("a3"), "fusion_decode_capacity": 0.25}
        mix.append(Job(f"fused-evict-{i}", text, 12, evict, expect="fused"))
    # Dropped midway: long decodes the client abandons after the first event.
    for i in range(2):
        mix.append(
            Job(
                f"abort-fused-{i}",
                f"Note:\n{docs[4 + i]}\nAbort {i}: tell everything.\nA:",
                max_new_tokens=200,
                custom=_fused("freq"),
                stream=True,
                abort=True,
                expect="fused",
            )
        )
        mix.append(
            Job(
                f"abort-normal-{i}",
                f"Abort {i}. {long_text[2000:3500]}\nGo on:",
                max_new_tokens=200,
                stream=True,
                abort=True,
            )
        )
    assert len(mix) >= 48
    return mix


def _run(url: str, job: Job) -> Outcome | None:
    response = requests.post(url + "/generate", json=job.body(), timeout=900, stream=job.stream)
    assert response.status_code == 200, f"{job.name}: {response.status_code} {response.text[:300]}"
    if not job.stream:
        return _outcome(response.json())
    last: dict[str, Any] | None = None
    for line in response.iter_lines():
        if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
            continue
        last = json.loads(line[len(b"data:") :])
        if job.abort:
            response.close()  # the client goes away mid-decode
            return None
    assert last is not None, f"{job.name}: empty stream"
    return _outcome(last)


def _outcome(payload: dict[str, Any]) -> Outcome:
    meta = payload["meta_info"]
    return Outcome(
        output_ids=tuple(payload["output_ids"]),
        fusion=tuple(meta.get("hicache_ext_fusion") or ()),
        input_logprobs=len(meta.get("input_token_logprobs") or ()),
    )


def _check_report(job: Job, outcome: Outcome) -> None:
    reports = [r for r in outcome.fusion if r is not None]
    if job.expect == "fused":
        assert len(reports) == 1 and reports[0]["fused"], f"{job.name}: {reports}"
        if "fusion_decode_capacity" in job.custom:  # the decode attended only the kept rows
            assert reports[0]["decode_kept_tokens"] > 0, f"{job.name}: {reports}"
    elif job.expect != "normal":
        reasons = {r.get("fallback") for r in reports}
        assert reports and reasons <= set(job.expect.split("|")), f"{job.name}: {reports}"
    else:
        assert not any(r.get("fused") for r in reports), f"{job.name}: {reports}"


def _server_alive(config: ServerConfig) -> None:
    assert requests.get(config.url + "/health", timeout=60).status_code == 200
    info = requests.get(config.url + "/server_info", timeout=60).json()
    assert info["internal_states"][0]["hicache_ext"]["fusion"] is not None


def test_concurrent_mixed_traffic_matches_one_by_one(
    chunked_prefill_server: ServerConfig, jobs: list[Job]
) -> None:
    url = chunked_prefill_server.url
    # One one-by-one run per distinct request (the mix sends some twice).
    distinct = {job.key(): job for job in jobs if not job.abort}
    by_body = {key: _run(url, job) for key, job in distinct.items()}
    reference = {job.name: by_body[job.key()] for job in jobs if not job.abort}
    for job in jobs:
        if not job.abort:
            _check_report(job, reference[job.name])  # type: ignore[arg-type]
            if job.logprobs:
                assert reference[job.name].input_logprobs >= 20  # type: ignore[union-attr]
    for round_ in range(ROUNDS):
        order = random.Random(round_).sample(jobs, len(jobs))
        with ThreadPoolExecutor(max_workers=len(order)) as pool:
            results = list(pool.map(lambda j: _run(url, j), order))
        outcomes = {job.name: got for job, got in zip(order, results, strict=True)}
        mismatches = []
        for job in jobs:
            if job.abort:
                continue
            got = outcomes[job.name]
            assert got is not None
            _check_report(job, got)
            if got.output_ids != reference[job.name].output_ids:  # type: ignore[union-attr]
                mismatches.append(job.name)
        assert not mismatches, f"round {round_}: outputs differ from one-by-one runs: {mismatches}"
        _server_alive(chunked_prefill_server)
        print(f"round {round_ + 1}/{ROUNDS}: {len(order)} concurrent requests, 0 mismatches")
    # Every fused answer was to be shadow-checked; with no spare capacity while the traffic ran
    # the queue filled, and what did not fit was dropped and counted, never held.
    checks = requests.get(url + "/hicache_ext/shadow_checks", timeout=60).json()
    counts = checks["counts"]
    assert checks["pending"] <= SHADOW_QUEUE
    assert counts["queued"] > SHADOW_QUEUE and counts["dropped_queue_full"] > 0
    assert counts.get("failed", 0) == 0


def test_reproduction_split_normal_requests_beside_fused(
    chunked_prefill_server: ServerConfig, jobs: list[Job]
) -> None:
    """The issue's reproduction: 4 fused + 4 long normal requests at once, 128-token rounds."""
    url = chunked_prefill_server.url
    picked = [j for j in jobs if j.expect == "fused" and not j.stream][:4] + [
        j for j in jobs if j.name.startswith("normal-long")
    ][:4]
    for _ in range(ROUNDS):
        with ThreadPoolExecutor(max_workers=8) as pool:
            outcomes = list(pool.map(lambda j: _run(url, j), picked))
        for job, outcome in zip(picked, outcomes, strict=True):
            assert outcome is not None
            _check_report(job, outcome)
        _server_alive(chunked_prefill_server)
    stats = requests.get(url + "/server_info", timeout=60).json()["internal_states"][0]
    assert stats["hicache_ext"]["fusion"]["fused_requests"] >= 4 * ROUNDS


def _generate(url: str, text: str, custom: dict[str, Any], **extra: Any) -> dict[str, Any]:
    sampling = {"max_new_tokens": 8, "temperature": 0, "custom_params": custom}
    body = {"text": text, "sampling_params": sampling, **extra}
    response = requests.post(url + "/generate", json=body, timeout=900)
    assert response.status_code == 200, response.text
    return response.json()


def _gaps(mine: list[list[Any]], theirs: list[list[Any]]) -> list[float]:
    """|a - b| of two [logprob, token id, text] lists over the same token ids."""
    assert [e[1] for e in mine] == [e[1] for e in theirs]
    return [abs(a[0] - b[0]) for a, b in zip(mine, theirs, strict=True) if a[0] is not None]


def _max_logprob_gap(fused: dict[str, Any], normal: dict[str, Any]) -> float:
    mine, theirs = fused["meta_info"], normal["meta_info"]
    gaps = [0.0]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        assert len(mine[key]) > 0
        gaps += _gaps(mine[key], theirs[key])
    for key in ("input_top_logprobs", "output_top_logprobs"):
        for top_mine, top_theirs in zip(mine[key], theirs[key], strict=True):
            gaps += _gaps(top_mine or [], top_theirs or [])
    return max(gaps)


def test_fused_logprobs_match_the_normal_prefill(
    chunked_prefill_server: ServerConfig, jobs: list[Job]
) -> None:
    """Input and output logprobs (and top-3) with fusion at r = 1 equal the normal prefill's
    within fp32 noise, over a prompt split into 3 rounds; at r = 0.15 they come back fused."""
    url = chunked_prefill_server.url
    notes = [j.text for j in jobs if j.name.startswith("fused-split")][:2]
    prompt = "Logprob check.\n" + "\n".join(notes) + "\nSo:"
    extra = {"return_logprob": True, "logprob_start_len": 5, "top_logprobs_num": 3}
    fused = _generate(url, prompt, _fused("full"), **extra)
    assert fused["meta_info"]["hicache_ext_fusion"][0]["prefill_rounds"] >= 2
    normal = _generate(url, prompt, {}, **extra)
    assert fused["output_ids"] == normal["output_ids"]
    gap = _max_logprob_gap(fused, normal)
    print(f"fused (r=1) vs normal logprobs: max abs difference {gap:.2e}")
    assert gap < 1e-3
    output_only = _generate(
        url, prompt.replace("Logprob", "Output"), _fused("a3"), return_logprob=True
    )
    (info,) = output_only["meta_info"]["hicache_ext_fusion"]
    assert info["fused"] and info["tokens_reused"] > 0
    assert len(output_only["meta_info"]["output_token_logprobs"]) == 8
