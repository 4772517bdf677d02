"""Host memory under pressure while traffic arrives at once: the retention compresses and drops
chunks that concurrent fused requests are reading, and clients hang up mid-request.

A server with `auto_chunks` and a host budget of about six paragraphs' dense rows takes a
burst of requests over twelve paragraphs, half of them seen once before: fused at ratio 1 (so
each answer must equal its prompt's one-by-one normal prefill, whatever was compressed or
dropped under it), fusion off, and streamed fused requests whose client hangs up before the
first token. Afterwards host memory
is within its budget, its bytes per form add up to what it holds, the retention compressed
under the burst, and no pin is left behind: every chunk can be deleted, which a pin held by an
aborted request would refuse (409)."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from sglang_hicache_ext.evaluation.hotpotqa import load_hotpotqa
from sglang_hicache_ext.sglang_ext.server.launcher import ServerConfig, running_server
from sglang_hicache_ext.sglang_ext.server.ports import free_port

pytestmark = pytest.mark.server

SYSTEM = "Answer the question from the documents in a few words."
# Host memory for chunks, in tokens of dense rows: about the six paragraphs seen before the
# burst (so they are kept); the burst brings six more.
BUDGET_TOKENS = 700


def _dense_bytes_per_token(model_path: Path) -> int:
    """fp32 K and V of one token over every layer (the CPU server's dtype)."""
    config = json.loads((model_path / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4


@pytest.fixture(scope="module")
def server(tiny_smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    workdir = tmp_path_factory.mktemp("retention_pressure")
    budget = BUDGET_TOKENS * _dense_bytes_per_token(tiny_smollm2_path)
    settings = {"auto_chunks": True, "fusion_by_default": True, "chunk_store_bytes": budget}
    config = ServerConfig(
        model_path=str(tiny_smollm2_path),
        port=free_port(),
        max_total_tokens=20_000,
        # Prompts and captures span several prefill rounds.
        extra_args=("--chunked-prefill-size", "256"),
    ).with_settings(workdir / "settings.json", settings)
    with running_server(config, log_path=workdir / "server.log") as running:
        yield running.url


Prompt = tuple[list[str], str]


def twin_prompts(
    fresh: list[str], pairs: int, seed: int
) -> tuple[list[Prompt], list[tuple[list[str], str, dict[str, Any]]]]:
    """`pairs` random (seen, new) pairs of documents, `fresh[:6]` seen and `fresh[6:12]` new,
    each asked twice, the second time in the other order: the prompts, and as jobs with the
    request's custom params, the first fused at ratio 1 and the second with fusion off."""
    chosen = random.Random(seed).sample([(s, n) for s in range(6) for n in range(6, 12)], pairs)
    prompts = [
        (docs, f"What is document {1 + n % 2} about?")
        for n, (i, j) in enumerate(chosen)
        for docs in ([fresh[i], fresh[j]], [fresh[j], fresh[i]])
    ]
    ratio_one = {"fusion_selector": "full", "fusion_recompute_ratio": 1.0}
    jobs = [
        (*prompt, ratio_one if n % 2 == 0 else {"fusion": False})
        for n, prompt in enumerate(prompts)
    ]
    return prompts, jobs


def _body(documents: list[str], question: str, custom: dict[str, Any], **extra: Any) -> dict:
    text = "\n\n".join(f"Document {i + 1}. {doc}" for i, doc in enumerate(documents))
    return {
        "text": f"{SYSTEM}\n\n{text}\n\nQuestion: {question}\nAnswer:",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "custom_params": custom},
        **extra,
    }


def _answer(
    url: str, documents: list[str], question: str, custom: dict[str, Any]
) -> tuple[str, list[Any]]:
    """The answer and the request's fusion report."""
    response = requests.post(
        url + "/generate", json=_body(documents, question, custom), timeout=600
    )
    assert response.status_code == 200, response.text
    payload = response.json()
    return payload["text"], payload["meta_info"].get("hicache_ext_fusion") or []


def _abandoned(url: str, documents: list[str], question: str) -> None:
    """A streamed fused request whose client hangs up once the response has begun, before its
    first token: during its prefill (its prompt spans several rounds) or just after."""
    body = _body(documents, question, {}, stream=True)
    body["sampling_params"]["max_new_tokens"] = 200
    with requests.post(url + "/generate", json=body, timeout=600, stream=True) as response:
        assert response.status_code == 200, response.text
    # Leaving the block closes the connection without reading an event.


def _host(url: str) -> dict[str, Any]:
    """GET /chunks: every chunk and host memory's stats."""
    return requests.get(url + "/chunks", timeout=30).json()


def test_burst_under_pressure_equals_one_by_one_and_leaves_no_pin(server: str) -> None:
    docs = [d for example in load_hotpotqa(12, seed=41) for d in example.documents]
    fresh = [d for d in docs if len(d) > 250][:12]
    assert len(fresh) == 12
    # Seen once before, fused one by one (so kept): the burst fuses them while it captures the
    # others and host memory makes room.
    captured = _stats(server)["auto_chunks"]["captured"]
    for i in range(0, 6, 2):
        _answer(server, fresh[i : i + 2], "Which document is longer?", {})
    seeded = _stats(server)
    assert seeded["auto_chunks"]["captured"] >= captured + 6, (
        seeded["auto_chunks"],
        seeded["chunks"],
    )
    prompts, jobs = twin_prompts(fresh, 6, seed=7)
    dropped = [(fresh[k : k + 4], f"Tell everything about {k}.") for k in range(4)]
    with ThreadPoolExecutor(max_workers=len(jobs) + len(dropped)) as pool:
        abandoned = [pool.submit(_abandoned, server, *job) for job in dropped]
        together = list(pool.map(lambda job: _answer(server, *job), jobs))
        for future in abandoned:
            future.result()
    fused = [report for _, reports in together for report in reports if report]
    assert any(r.get("fused") for r in fused), fused  # ratio-1 requests fused under the burst
    alone = [_answer(server, d, q, {"fusion": False})[0] for d, q in prompts]
    assert [text for text, _ in together] == alone

    stats = _host(server)["stats"]
    assert stats["compressed_to_int8"] >= 1, stats  # the burst ran under pressure
    assert stats["bytes_used"] <= stats["capacity_bytes"], stats
    assert sum(stats["bytes_by_form"].values()) == stats["bytes_used"], stats
    # Every pin is released once the requests, the abandoned ones too, have ended.
    ids = [chunk["id"] for chunk in _host(server)["chunks"]]
    assert ids
    deadline = time.monotonic() + 60
    while ids:
        status = {i: requests.delete(f"{server}/chunks/{i}", timeout=30).status_code for i in ids}
        assert set(status.values()) <= {200, 409}, status
        ids = [i for i, code in status.items() if code == 409]
        assert not ids or time.monotonic() < deadline, f"still pinned after 60 s: {ids}"
        time.sleep(0.5 if ids else 0)
    emptied = _host(server)["stats"]
    assert (emptied["entries"], emptied["bytes_used"], emptied["bytes_by_form"]) == (0, 0, {})


def _stats(url: str) -> dict[str, Any]:
    info = requests.get(url + "/server_info", timeout=30).json()
    return info["internal_states"][0]["hicache_ext"]
