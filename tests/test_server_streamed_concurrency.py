"""Concurrent fused requests over chunks streamed from the disk tier, split by chunked prefill.

Host memory holds no chunk (`chunk_store_bytes` = 1), so every fused request streams its chunks'
rows from disk on the layer loader's thread, several requests at once over the same chunk
files, while the scheduler splits prompts into 128-token rounds. Each output must equal the same
request run alone, and at r = 1 the normal prefill's.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from sglang_hicache_ext.sglang_ext.server.launcher import ServerConfig, running_server
from sglang_hicache_ext.sglang_ext.server.ports import free_port
from tests.test_server_restart import DOCUMENTS, _chunks, _fused

pytestmark = pytest.mark.server

QUESTIONS = ("which entry is oldest?", "which record is longest?", "what was filed in 1905?")


def _prompts() -> list[str]:
    orders = list(itertools.permutations(DOCUMENTS))[:4]
    return [
        "Documents:\n" + "\n".join(order) + f"\nQuestion: {question}\nAnswer:"
        for order, question in zip(orders, itertools.cycle(QUESTIONS))
    ]


def test_concurrent_streamed_requests_equal_one_by_one(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    settings = {"chunk_disk_dir": str(tmp_path / "chunks"), "chunk_store_bytes": 1}
    config = ServerConfig(
        model_path=str(tiny_llama_path),
        port=free_port(),
        max_total_tokens=4096,
        extra_args=("--chunked-prefill-size", "128"),
    ).with_settings(tmp_path / "hicache_ext.json", settings)
    with running_server(config, log_path=tmp_path / "server.log"):
        for document in DOCUMENTS:
            response = requests.post(config.url + "/chunks", json={"text": document}, timeout=120)
            assert response.status_code == 200, response.text
        prompts = _prompts()
        jobs = [(text, ratio) for text in prompts for ratio in (0.15, 1.0)]
        alone = [_fused(config.url, ratio, text=text) for text, ratio in jobs]
        for (_, ratio), (_, info) in zip(jobs, alone, strict=True):
            assert info["fused"] and info["chunks_by_tier"] == {"disk": 3}, info
            # r = 1 reuses no row (and needs no scoring pass): nothing is read from the disk.
            assert (info["load"]["bytes_read"] > 0) == (ratio < 1.0), (ratio, info["load"])
        with ThreadPoolExecutor(len(jobs)) as pool:
            together = list(pool.map(lambda job: _fused(config.url, job[1], text=job[0]), jobs))
        for (text, ratio), (ids, info), (ids_alone, _) in zip(jobs, together, alone, strict=True):
            assert info["fused"] and info["chunks_by_tier"] == {"disk": 3}, info
            assert ids == ids_alone, (text[-40:], ratio)
        for text in prompts:  # r = 1 recomputes everything: the normal prefill's answer
            normal = requests.post(
                config.url + "/generate",
                json={"text": text, "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
                timeout=300,
            ).json()["output_ids"]
            assert normal == alone[jobs.index((text, 1.0))][0]
        stats = _chunks(config.url)["stats"]
        assert stats["hits_by_tier"]["disk"] == 2 * len(jobs) * 3, stats
        assert stats["disk"]["corrupt_dropped"] == 0 and stats["lost"] == 0
        print(
            f"\n{len(jobs)} concurrent streamed requests equal one-by-one; disk hits "
            f"{stats['hits_by_tier']['disk']}"
        )
