"""A local cluster (`hicache-ext-cluster`): two servers sharing one chunk tier behind SGLang's
router (smg), on the tiny model.

Documents one server keeps from ordinary chat traffic are reused by the other, which has never
seen them, from the shared tier; a server killed with SIGKILL loses no chunk (the store process
holds them), the router stops sending to it within seconds and the survivor keeps reusing; the
server started again reuses what was stored before. Stopping the cluster leaves no process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests

from sglang_hicache_ext.evaluation.hotpotqa import load_hotpotqa
from sglang_hicache_ext.sglang_ext.server.ports import free_port
from sglang_hicache_ext.sglang_ext.tools.cluster import ClusterSpec, LocalCluster, core_shares

pytestmark = pytest.mark.server

SETTINGS = {"auto_chunks": True, "auto_chunks_per_minute": 600, "fusion_by_default": True}


def _documents() -> list[str]:
    docs = [doc for example in load_hotpotqa(6, seed=31) for doc in example.documents]
    return [doc for doc in docs if len(doc) > 250][:6]


MODEL = "tiny-llama"  # the cluster serves the model under its folder's name


def _chat(url: str, documents: list[str], question: str) -> dict[str, Any]:
    body = "\n\n".join(f"Document {i + 1}. {doc}" for i, doc in enumerate(documents))
    response = requests.post(
        url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "Answer from the documents."},
                {"role": "user", "content": f"{body}\n\nQuestion: {question}"},
            ],
            "max_tokens": 4,
            "temperature": 0,
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response.json()


def _cached(reply: dict[str, Any]) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def _chunks(url: str) -> dict[str, Any]:
    info = requests.get(url + "/server_info", timeout=30).json()
    return info["internal_states"][0]["hicache_ext"]["chunks"]


def _tokens(url: str, texts: list[str]) -> int:
    return sum(
        len(requests.post(url + "/tokenize", json={"prompt": t}, timeout=30).json()["tokens"])
        for t in texts
    )


def _group(pid: int) -> set[int]:
    return {p.pid for p in psutil.process_iter() if _pgid(p.pid) == pid} | {pid}


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.add(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_documents_seen_on_one_server_are_reused_on_the_other_and_outlive_it(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    docs = _documents()
    spec = ClusterSpec(
        model_path=str(tiny_llama_path),
        servers=2,
        port=free_port(),
        settings=SETTINGS,
        server_args=("--enable-cache-report",),
        max_total_tokens=8192,
        log_dir=tmp_path,
        store_bytes=256 << 20,
    )
    cluster = LocalCluster(spec)
    pids: set[int] = set()
    try:
        began = time.monotonic()
        cluster.start()
        started_s = time.monotonic() - began
        a, b = (config.url for config in cluster.configs)
        assert cluster.model_name == MODEL == tiny_llama_path.name
        pids = set().union(*(_group(pid) for pid in cluster.pids().values()))
        assert cluster.master is not None
        pids |= {p.pid for p in cluster.master._processes}

        # Server A computes the documents once and keeps them (auto_chunks) in the shared tier.
        first = _chat(a, docs[:3], "Which document is the oldest?")
        assert _cached(first) < 40
        assert _chunks(a)["mooncake"]["catalog"]["published"] >= 3
        # Server B has never seen them: in another order, they are reused from the shared tier.
        doc_tokens = _tokens(b, docs[:3])
        second = _chat(b, [docs[2], docs[0], docs[1]], "Who is named first?")
        assert _cached(second) >= 0.7 * doc_tokens, (_cached(second), doc_tokens)
        chunks_b = _chunks(b)
        assert chunks_b["found_in_shared_tier"] >= 3 and chunks_b["hits_by_tier"]["mooncake"] >= 3

        # A dies (SIGKILL). Through the router: errors only until its health checks notice.
        cluster.kill_server(0)
        killed_at = time.monotonic()
        errors_after: list[float] = []
        for n in range(8):
            try:
                reply = requests.post(
                    cluster.url + "/v1/chat/completions",
                    json={"model": MODEL, "messages": [{"role": "user", "content": f"Hi {n}"}],
                          "max_tokens": 2},
                    timeout=60,
                )  # fmt: skip
                ok = reply.status_code == 200
            except requests.RequestException:
                ok = False
            if not ok:
                errors_after.append(time.monotonic() - killed_at)
            time.sleep(0.5)
        assert all(t < 4.0 for t in errors_after), errors_after  # none once it is marked down
        # The survivor reuses the documents through the router (the only worker left).
        third = _chat(cluster.url, [docs[1], docs[2], docs[0]], "Which is the longest?")
        assert _cached(third) >= 0.7 * doc_tokens

        # A again, with nothing in memory: what was stored before is reused from the store.
        cluster.restart_server(0)
        fourth = _chat(a, [docs[0], docs[2], docs[1]], "Which is the newest?")
        assert _cached(fourth) >= 0.7 * doc_tokens
        assert _chunks(a)["hits_by_tier"]["mooncake"] >= 3
        pids |= _group(cluster.processes[0].pid)
    finally:
        cluster.stop()
    assert started_s < 90
    time.sleep(0.5)
    assert _alive(pids) == set(), [psutil.Process(p).cmdline() for p in _alive(pids)]


def test_cluster_flags_that_cannot_work_stop_in_one_line(tiny_llama_path: Path) -> None:
    """Nothing is started: the checks run before the first component."""
    command = [sys.executable, "-m", "sglang_hicache_ext.sglang_ext.tools.cluster"]
    model = ["--model", str(tiny_llama_path)]
    cases = {
        "--servers must be at least 1": [*model, "--servers", "0"],
        "no such folder": ["--model", "/no/such/model"],
        "fusion_shadow_rate = 2 must be in [0, 1]": [*model, "--settings",
                                                     json.dumps({"fusion_shadow_rate": 2})],
    }  # fmt: skip
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cases["is already in use"] = [*model, "--port", str(busy.getsockname()[1])]
        cases["no smg (SGLang Model Gateway) there"] = [*model, "--smg", "/no/such/smg"]
        for expected, args in cases.items():
            done = subprocess.run([*command, *args], capture_output=True, text=True, timeout=60)
            assert done.returncode in (1, 2) and expected in done.stderr, done.stderr
            assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_cores_are_split_between_servers() -> None:
    assert core_shares(2, [0, 1]) == [(0,), (1,)]
    assert core_shares(2, [0, 1, 2, 3, 4]) == [(0, 1), (2, 3)]
    assert core_shares(3, [0, 1]) == [(0,), (1,), (0,)]
