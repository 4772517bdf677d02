"""A server restarted 1 s after `kill -9` starts on the same port (no false "port in use"), and
finds the chunks registered before on its chunk disk tier: fused requests hit them without a
new registration and answer exactly as before the crash. With the recompute ratio "auto", each
request takes the ratio tuned for the tier its chunks are loaded from. A chunk file damaged while
the server was down is never used: the request reading it gets the normal prefill."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest
import requests

from sglang_hicache_ext.sglang_ext.server.launcher import (
    ServerConfig,
    running_server,
    server_process_group,
)
from sglang_hicache_ext.sglang_ext.server.ports import free_port
from sglang_hicache_ext.tiers.chunks.stored_forms import read_header
from sglang_hicache_ext.tuning.ratio.table import RatioTable, TunedRatio
from tests.server_processes import TCP_LISTEN, tcp_states_on_port

pytestmark = pytest.mark.server


DOCUMENTS = [
    f"Record {topic}: "
    + " ".join(f"the {topic} entry {i} was filed in {1900 + i}." for i in range(12))
    for topic in ("lighthouses", "glaciers", "orchards")
]
PROMPT = "Documents:\n" + "\n".join(DOCUMENTS[::-1]) + "\nQuestion: which entry is oldest?\nAnswer:"
DAMAGED = "Record tides: " + " ".join(f"the tide {i} rose at {i % 12} o'clock." for i in range(12))


def small_server(model: Path, folder: Path, settings: dict[str, object]) -> ServerConfig:
    """`model` over a 2,048-token pool, with the extension's `settings` (written in `folder`)."""
    config = ServerConfig(model_path=str(model), port=free_port(), max_total_tokens=2048)
    return config.with_settings(folder / "hicache_ext.json", settings)


# Tuned ratios of this test (a real table comes from `tuning.ratio tune`): disk loads cost more.
RATIOS = {"host": 0.15, "disk": 0.4}


def _fused(
    url: str, ratio: float | str, text: str = PROMPT, **custom: object
) -> tuple[list[int], dict]:
    response = requests.post(
        url + "/generate",
        json={
            "text": text,
            "sampling_params": {
                "max_new_tokens": 8,
                "temperature": 0,
                "custom_params": {"fusion": True, "fusion_recompute_ratio": ratio, **custom},
            },
        },
        timeout=300,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    (info,) = body["meta_info"]["hicache_ext_fusion"]
    return body["output_ids"], info


def _chunks(url: str) -> dict:
    response = requests.get(url + "/chunks", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def _wait_until_promoted(url: str, ids: list[str], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        tiers = {c["id"]: c["tier"] for c in _chunks(url)["chunks"]}
        if all(tiers.get(i) == "host" for i in ids):
            return
        time.sleep(0.2)
    raise AssertionError(f"chunks not promoted to host memory within {timeout_s} s: {tiers}")


def test_restart_one_second_after_kill_9(tiny_llama_path: Path, tmp_path: Path) -> None:
    table = RatioTable(
        tiny_llama_path.name,
        {tier: TunedRatio(r, r, 0.15, 1.0, "test") for tier, r in RATIOS.items()},
    )
    table.save(tmp_path / "ratios.json")
    settings = {
        "chunk_disk_dir": str(tmp_path / "chunk-disk"),
        "fusion_ratio_table": str(tmp_path / "ratios.json"),
    }
    config = small_server(tiny_llama_path, tmp_path, settings)
    with running_server(config, log_path=tmp_path / "first.log"):
        ids = []
        for document in DOCUMENTS:
            created = requests.post(config.url + "/chunks", json={"text": document}, timeout=120)
            assert created.status_code == 200, created.text
            ids.append(created.json()["id"])
        listed = _chunks(config.url)
        assert {c["id"]: c["tiers"] for c in listed["chunks"]} == {i: ["host", "disk"] for i in ids}
        damaged = requests.post(config.url + "/chunks", json={"text": DAMAGED}, timeout=120)
        assert damaged.status_code == 200, damaged.text
        damaged_id = damaged.json()["id"]
        normal = requests.post(
            config.url + "/generate",
            json={"text": DAMAGED, "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
            timeout=300,
        ).json()["output_ids"]
        before, info = _fused(config.url, RATIOS["disk"], fusion_selector="question_error")
        assert info["fused"] and info["chunks_by_tier"] == {"host": 3}, info
        assert (info["recompute_ratio"], info["ratio_source"]) == (RATIOS["disk"], "fixed")
        # A keep-alive connection that has served a request, as a live server has.
        session = requests.Session()
        response = session.post(
            config.url + "/generate",
            json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}},
            timeout=120,
        )
        assert response.status_code == 200
        os.killpg(server_process_group(config.port), signal.SIGKILL)
        killed_at = time.monotonic()
        session.close()  # the client answers the dead server's FIN
    leftovers = tcp_states_on_port(config.port)
    assert TCP_LISTEN not in leftovers
    # The old check (a bind without SO_REUSEADDR) would refuse the port now.
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind((config.host, config.port))
    # A bad sector in the damaged chunk's keys while the server is down.
    (path,) = (tmp_path / "chunk-disk").rglob(f"{damaged_id}.chunk")
    header = read_header(path)
    with open(path, "r+b") as file:
        file.seek(header.key_offset(1) + 3 * header.key_row_bytes + 5)
        byte = file.read(1)
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte[0] ^ 0x08]))
    time.sleep(max(0.0, 1.0 - (time.monotonic() - killed_at)))
    restarted_at = time.monotonic()
    with running_server(config, log_path=tmp_path / "second.log", startup_timeout_s=180):
        assert requests.get(config.url + "/health", timeout=10).status_code == 200
        healthy_s = time.monotonic() - restarted_at
        listed = _chunks(config.url)
        assert {c["id"]: c["tier"] for c in listed["chunks"]} == dict.fromkeys(
            [*ids, damaged_id], "disk"
        )  # its header is sound: the damage is found when its rows are read
        assert listed["stats"]["restored_from_disk"] == 4
        # No registration since the restart; "auto" loads from disk at the disk's ratio. A
        # check-layer selector: the default's scoring pass reads every row of its layers.
        after, info = _fused(config.url, "auto", fusion_selector="question_error")
        assert info["fused"] and info["chunks_by_tier"] == {"disk": 3}, info
        # The default token-agreement target starts each tier at its tuned ratio (no check has
        # moved it on this server).
        assert (info["recompute_ratio"], info["ratio_source"]) == (RATIOS["disk"], "target")
        assert info["ratio_start"] == "tuned" and info["ratio_tier"] == "disk"
        assert after == before
        # Streamed: only the rows not recomputed were read, a layer ahead of the compute.
        load = info["load"]
        assert 0 < load["bytes_read"] <= 0.9 * load["bytes_dense"] and load["overlapped"], load
        _wait_until_promoted(config.url, ids)  # in the background, after the request
        _, again = _fused(config.url, "auto")
        assert again["chunks_by_tier"] == {"host": 3}
        assert (again["recompute_ratio"], again["ratio_start"]) == (RATIOS["host"], "tuned")
        stats = _chunks(config.url)["stats"]
        assert stats["hits_by_tier"] == {"host": 3, "disk": 3, "miss": 0}, stats
        assert stats["disk"]["corrupt_dropped"] == 0
        # Every row of the damaged chunk is read at r = 0: the bad one stops the fused forward,
        # the normal prefill answers, the chunk is dropped and counted.
        output, info = _fused(config.url, 0.0, DAMAGED, fusion_selector="reuse")
        assert info == {"fused": False, "fallback": "chunk_unreadable"}, info
        assert output == normal
        listed = _chunks(config.url)
        assert damaged_id not in {c["id"] for c in listed["chunks"]}
        assert listed["stats"]["disk"]["corrupt_dropped"] == 1
        assert not path.exists()
        print(
            f"\nrestart {restarted_at - killed_at:.1f} s after kill -9 (sockets left on the port: "
            f"{leftovers}): healthy after {healthy_s:.0f} s; 3 chunks found on disk, fused "
            f"output equal to before the kill: {after == before}"
        )
