"""End-to-end: two CPU servers share chunks through a real Mooncake master on loopback.

Server A registers documents (prefilled once, written through to the shared tier); server B,
another process, registers the same texts and gets them from the shared tier without a prefill,
and its fused requests load their KV from there and answer as A's do. With the master killed
mid-serve, B's request for a chunk it has not loaded yet computes those tokens and answers as the
normal prefill does, the failed read is counted, and both servers keep serving (A's new
registration stays in host memory, its failed write counted). A master that is not listening at
launch stops the launch in one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from sglang_hicache_ext.sglang_ext.server.launcher import ServerConfig, running_servers
from sglang_hicache_ext.sglang_ext.server.ports import free_port
from sglang_hicache_ext.sglang_ext.tools.mooncake_master import running_master
from tests.test_preflight import _assert_clear_error, refused_launch
from tests.test_server_restart import DOCUMENTS, _chunks, _fused

pytestmark = pytest.mark.server

LATE = "Record comets: " + " ".join(
    f"the comet {i} returned after {70 + i} years." for i in range(12)
)
LATE_PROMPT = "Documents:\n" + LATE + "\nQuestion: which comet returned last?\nAnswer:"
RATIO = 0.5


def _config(
    model: Path, tmp_path: Path, name: str, master: str, segment_bytes: int
) -> ServerConfig:
    settings = {"chunk_mooncake_master": master, "chunk_mooncake_segment_bytes": segment_bytes}
    return ServerConfig(
        model_path=str(model), port=free_port(), max_total_tokens=2048
    ).with_settings(tmp_path / f"{name}.json", settings)


def _register(url: str, text: str) -> dict:
    response = requests.post(url + "/chunks", json={"text": text}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _normal(url: str, text: str) -> list[int]:
    response = requests.post(
        url + "/generate",
        json={"text": text, "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
        timeout=300,
    )
    assert response.status_code == 200, response.text
    return response.json()["output_ids"]


def test_two_servers_share_chunks_and_survive_the_master(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    with running_master(tmp_path / "master.log") as master:
        config_a = _config(tiny_llama_path, tmp_path, "a", master.address, 256 << 20)
        config_b = _config(tiny_llama_path, tmp_path, "b", master.address, 0)
        servers = [(config_a, tmp_path / "a.log"), (config_b, tmp_path / "b.log")]
        with running_servers(servers) as (a, b):  # started together: their starts overlap
            ids = [_register(a.url, text)["id"] for text in (*DOCUMENTS, LATE)]
            assert {c["id"]: c["tiers"] for c in _chunks(a.url)["chunks"]} == {
                i: ["host", "mooncake"] for i in ids
            }
            on_a, info_a = _fused(a.url, RATIO)
            assert info_a["fused"] and info_a["chunks_by_tier"] == {"host": 3}, info_a

            # B: the same texts are found in the shared tier, not prefilled again.
            for text, chunk_id in zip((*DOCUMENTS, LATE), ids, strict=True):
                known = _register(b.url, text)
                assert (known["id"], known["created"], known["tier"]) == (
                    chunk_id,
                    False,
                    "mooncake",
                )
            on_b, info_b = _fused(b.url, RATIO)
            assert info_b["fused"] and info_b["chunks_by_tier"] == {"mooncake": 3}, info_b
            assert on_b == on_a
            load = info_b["load"]  # fetched whole while pinning: nothing of it overlapped
            assert load["bytes_read"] == load["bytes_dense"] > 0 and not load["overlapped"], load
            assert load["wait_s"] == pytest.approx(load["read_s"]) and load["read_s"] > 0
            stats_b = _chunks(b.url)["stats"]
            assert stats_b["hits_by_tier"]["mooncake"] == 3, stats_b
            assert stats_b["mooncake"]["discovered"] == 4 and stats_b["mooncake"]["hits"] == 3
            print(f"\nB fused from the shared tier: {info_b['chunks_by_tier']}, outputs equal A's")

            master.kill()
            # B has LATE's header only: its rows cannot be fetched now; the tokens are computed.
            fused_late, info_late = _fused(b.url, RATIO, text=LATE_PROMPT)
            assert info_late == {"fused": False, "fallback": "no_chunk_matched"}, info_late
            assert fused_late == _normal(b.url, LATE_PROMPT)
            stats_b = _chunks(b.url)["stats"]
            assert stats_b["mooncake"]["read_errors"] >= 1, stats_b
            again, info_again = _fused(b.url, RATIO)  # promoted to B's host memory before
            assert info_again["chunks_by_tier"] == {"host": 3} and again == on_a
            # A registers a new chunk: kept in host memory, the failed write counted.
            extra = _register(
                a.url, "Record rivers: " + " ".join(f"river {i} floods." for i in range(40))
            )
            assert extra["tiers"] == ["host"], extra
            assert _chunks(a.url)["stats"]["mooncake"]["write_errors"] >= 1
            for server in (a, b):
                assert requests.get(server.url + "/health", timeout=30).status_code == 200
            print(
                f"master down: B fallback {info_late['fallback']}, read errors "
                f"{stats_b['mooncake']['read_errors']}; A write errors counted, both healthy"
            )


def test_launch_with_the_master_not_listening(tiny_llama_path: Path, tmp_path: Path) -> None:
    closed = f"127.0.0.1:{free_port()}"
    config = ServerConfig(model_path=str(tiny_llama_path), port=free_port()).with_settings(
        tmp_path / "ext.json", {"chunk_mooncake_master": closed}
    )
    result = refused_launch(config, tmp_path / "refused.log")
    _assert_clear_error(
        result,
        f"chunk_mooncake_master {closed} is unreachable (Connection refused); start the "
        "Mooncake master there or unset chunk_mooncake_master",
    )
