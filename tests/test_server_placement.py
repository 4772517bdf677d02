"""The chunk placement in a real server: POST /hicache_ext/placement profiles every chunk with
probe requests (its registered rows against int8 / int4), then Algorithm 1 over (alpha *
quality - TTFT) * frequency chooses what host memory holds of each chunk; GET /chunks shows
each chunk's tier and codec as placed; the disk keeps the registered rows, so a restart loses
nothing, and the periodic timer places again. Bad alpha / floor values are a 400."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import requests

from sglang_hicache_ext.sglang_ext.server.launcher import ServerConfig, running_server
from sglang_hicache_ext.sglang_ext.server.ports import free_port

pytestmark = pytest.mark.server

DOCUMENTS = [
    f"Survey {topic}: "
    + " ".join(f"the {topic} site {i} was mapped in {1950 + 3 * i}." for i in range(12))
    for topic in ("moors", "fjords", "mesas", "atolls")
]
# One dense chunk (266 KB on this model) and one int8 chunk fit, two dense do not: the two chunks
# the traffic reads cannot both stay dense. (With room for both, the other two are never read,
# so (alpha * quality - TTFT) * frequency is 0 for them in every form and nothing need be
# compressed: that depended on a tie.)
HOST_BYTES = 400_000
FLOOR = 0.9


def _prompt(question: str) -> str:
    return f"Records:\n{DOCUMENTS[0]}\n{DOCUMENTS[1]}\nQuestion {question}: which site is newest?\nAnswer:"


def _fused(url: str, question: str) -> dict:
    response = requests.post(
        url + "/generate",
        json={
            "text": _prompt(question),
            "sampling_params": {
                "max_new_tokens": 4,
                "temperature": 0,
                "custom_params": {"fusion": True},
            },
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response.json()["meta_info"]["hicache_ext_fusion"][0]


def _place(url: str, **body: object) -> requests.Response:
    return requests.post(url + "/hicache_ext/placement", json=body, timeout=600)


def _listing(url: str) -> dict:
    return requests.get(url + "/chunks", timeout=30).json()


def _config(model: Path, tmp_path: Path, **settings: object) -> ServerConfig:
    path = tmp_path / f"settings{len(settings)}.json"
    values = {
        "chunk_disk_dir": str(tmp_path / "disk"),
        "chunk_store_bytes": HOST_BYTES,
        # A slow disk (266 KB take 0.13 s): holding chunks in host memory, compressed, pays.
        "chunk_disk_read_bytes_per_s": 2_000_000,
        # The probes run the server's selector; the expected forms below were measured with
        # this one on the random-weight tiny model (whose answers a selector's choice of rows
        # moves more than a real model's).
        "fusion_selector": "question_error",
        **settings,
    }
    return ServerConfig(
        model_path=str(model),
        port=free_port(),
        max_total_tokens=2048,
    ).with_settings(path, values)


def _assert_listing_is_the_placement(url: str, result: dict) -> None:
    listing = _listing(url)
    chunks = {c["id"]: c for c in listing["chunks"]}
    for placed in result["chunks"]:
        shown = chunks[placed["id"]]
        form = placed["host_form"]
        assert shown["tier"] == ("disk" if form is None else "host"), (placed, shown)
        assert shown["codec"] == (None if form in (None, "none") else form)
        assert shown["registered_codec"] is None and "disk" in shown["tiers"]
    assert listing["stats"]["bytes_used"] <= HOST_BYTES


def test_placement_profiles_places_and_survives_a_restart(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    config = _config(tiny_llama_path, tmp_path)
    with running_server(config, log_path=tmp_path / "first.log"):
        url = config.url
        ids = [
            requests.post(url + "/chunks", json={"text": d}, timeout=120).json()["id"]
            for d in DOCUMENTS
        ]
        assert requests.get(url + "/hicache_ext/placement", timeout=30).json()["rounds"] == 0
        # Before any placement, retention by utility (the default) made room for the four by
        # compressing a chunk a step where demoting it would cost a read off this slow disk.
        stats = _listing(url)["stats"]
        assert stats["compressed_to_int8"] >= 1 and stats["bytes_by_form"]["int8"] > 0
        assert stats["bytes_used"] <= HOST_BYTES and stats["lost"] == 0
        for question in "abc":
            assert _fused(url, question)["fused"]
        for body, message in [
            ({"alpha": -1}, '"alpha" must be >= 0, got -1'),
            ({"alpha": "high"}, '"alpha" must be a finite number'),
            ({"alpha": True}, '"alpha" must be a finite number'),
            ({"alpha": 10**400}, '"alpha" must be a finite number'),
            ({"quality_floor": 1.5}, '"quality_floor" must be in [0, 1], got 1.5'),
            ({"ratio": 0.5}, "unknown key(s) 'ratio'"),
            ({"profile_chunks": -1}, '"profile_chunks" must be an integer in [0, 100000]'),
        ]:
            refused = _place(url, **body)
            assert refused.status_code == 400 and message in refused.json()["error"], refused.text
        probe = requests.post(
            url + "/generate",
            json={
                "text": "hi",
                "sampling_params": {"custom_params": {"hicache_ext_probe_form": "int8"}},
            },
            timeout=60,
        )
        assert probe.status_code == 400 and "internal to the chunk placement" in probe.text

        placed = _place(url)
        assert placed.status_code == 200, placed.text
        result = placed.json()
        assert sorted(result["profiled"]) == sorted(ids) and result["probe_fallbacks"] == 0
        assert result["timing"] == {"disk_bytes_per_s": 2_000_000}
        assert sum(result["outcomes"].values()) == len(ids) and result["alpha"] == 20.0
        by_id = {c["id"]: c for c in result["chunks"]}
        assert by_id[ids[0]]["frequency"] == by_id[ids[1]]["frequency"] == 3.0
        for chunk in result["chunks"]:
            assert chunk["quality"]["none"] == 1.0
            if chunk["host_form"] is not None:
                assert chunk["quality"][chunk["host_form"]] >= FLOOR
        forms = [c["host_form"] for c in result["chunks"]]
        # The two read chunks stay in host memory; both dense do not fit, so one is compressed.
        assert by_id[ids[0]]["host_form"] and by_id[ids[1]]["host_form"]
        assert {"int8", "int4"} & set(forms), forms
        _assert_listing_is_the_placement(url, result)
        after = _fused(url, "d")
        assert after["fused"] and after["chunks_by_tier"] == {"host": 2}

        strict = _place(url, alpha=1000, quality_floor=1.0).json()
        # Re-profiled from real queries: the two chunks request "d" asked a new question about.
        assert strict["round"] == 2 and sorted(strict["profiled"]) == sorted(ids[:2])
        for chunk in strict["chunks"]:
            if chunk["host_form"] is not None:
                assert chunk["quality"][chunk["host_form"]] == 1.0
        _assert_listing_is_the_placement(url, strict)
        status = requests.get(url + "/hicache_ext/placement", timeout=30).json()
        assert (
            status["rounds"] == 2
            and status["last"]["round"] == 2
            and status["profiled_chunks"] == 4
        )

    # Restarted with the timer: the disk still holds every chunk (nothing a placement dropped
    # from host memory is lost) and rounds run by themselves.
    config = _config(tiny_llama_path, tmp_path, chunk_placement_interval_s=1.0)
    with running_server(config, log_path=tmp_path / "second.log"):
        url = config.url
        assert sorted(c["id"] for c in _listing(url)["chunks"]) == sorted(ids)
        deadline = time.monotonic() + 120
        status: dict = {}
        while time.monotonic() < deadline:
            status = requests.get(url + "/hicache_ext/placement", timeout=30).json()
            if status["rounds"] >= 2:
                break
            time.sleep(0.5)
        assert status["rounds"] >= 2, status
        assert status["profiled_chunks"] == len(ids)  # profiled again by the new process
        assert any(c["host_form"] for c in status["last"]["chunks"])  # back in host memory
        assert _fused(url, "e")["fused"]
