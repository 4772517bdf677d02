"""Fusion under `--tp-size 2`: two CPU scheduler ranks, each with its shard of the heads.

Server A (tiny Qwen2, 4 query / 2 KV heads: one KV head per rank) keeps chunks on disk and in a
Mooncake master on loopback, and prefills in rounds of 128 tokens; server B, another TP = 2
process, shares the master and keeps `auto_chunks`. Fused at r = 1 A answers as its own TP = 2
normal prefill (tokens and logprobs), concurrent requests too, and a client that hangs up leaves
it serving; at r = 0.15 both ranks recompute the same rows (compared by the ranks
before any KV is written: `tp_ranks_agree`). Each rank's shard is stored under a name of its
own in the master, B reads both shards back and answers as A, B's `auto_chunks` keeps a prompt's
documents and fuses them on its second sight, and A's chunks survive A's restart from its disk.
"""

from __future__ import annotations

import dataclasses
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from sglang_hicache_ext.sglang_ext.server.launcher import (
    ServerConfig,
    flush_cache,
    running_server,
    running_servers,
)
from sglang_hicache_ext.sglang_ext.server.ports import free_port
from sglang_hicache_ext.sglang_ext.tools.mooncake_master import running_master
from sglang_hicache_ext.tiers.chunks.mooncake_client import MooncakeClient, MooncakeConfig
from tests.test_server_model_families import _generate
from tests.test_server_restart import DOCUMENTS, _chunks

pytestmark = pytest.mark.server

# Each rank a core of its own (one NUMA node here: SGLang needs the bind spelled out).
TP2_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
QUESTION = "\nQuestion: which entry is oldest?\nAnswer:"
ORDERS = [(2, 0, 1), (1, 2, 0), (0, 1, 2)]
# Server A prefills in rounds of 128 tokens: a fused prompt spans several (computed in its first).
ROUNDS = ("--chunked-prefill-size", "128")
NOVEL = "Record ferries: " + " ".join(f"the ferry {i} left at {i % 12} o'clock." for i in range(12))


def _prompt(order: tuple[int, ...]) -> str:
    return "Documents:\n" + "\n".join(DOCUMENTS[i] for i in order) + QUESTION


def _config(model: Path, settings: Path, extra: dict[str, object], *flags: str) -> ServerConfig:
    return ServerConfig(
        model_path=str(model),
        port=free_port(),
        max_total_tokens=4096,
        extra_args=("--tp-size", "2", *flags),
        env=TP2_ENV,
    ).with_settings(settings, extra)


def _exact(url: str, prompt: str) -> tuple[dict, dict]:
    """The prompt fused at r = 1 and prefilled normally, each from an empty prefix tree."""
    flush_cache(url)
    fused = _generate(url, prompt, fusion=True, fusion_selector="full", fusion_recompute_ratio=1.0)
    flush_cache(url)
    return fused, _generate(url, prompt)


def _assert_same_answer(fused: dict, normal: dict) -> None:
    assert fused["output_ids"] == normal["output_ids"]
    fused_lp = [entry[0] for entry in fused["meta_info"]["output_token_logprobs"]]
    normal_lp = [entry[0] for entry in normal["meta_info"]["output_token_logprobs"]]
    assert fused_lp == pytest.approx(normal_lp, abs=1e-4)


def _info(response: dict) -> dict:
    return response["meta_info"]["hicache_ext_fusion"][-1]  # the request's last prefill round


def _hang_up(url: str, prompt: str) -> None:
    """A streamed fused request whose client goes away after the first event."""
    body = {
        "text": prompt,
        "stream": True,
        "sampling_params": {
            "max_new_tokens": 64,
            "temperature": 0,
            "custom_params": {"fusion": True, "fusion_recompute_ratio": 0.15},
        },
    }
    with requests.post(url + "/generate", json=body, timeout=600, stream=True) as response:
        assert response.status_code == 200, response.text
        next(line for line in response.iter_lines() if line.startswith(b"data:"))


def _register(url: str, text: str) -> dict:
    response = requests.post(url + "/chunks", json={"text": text}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_tensor_parallel_fusion(tiny_qwen2_path: Path, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    with running_master(tmp_path / "master.log") as master:
        mooncake = {"chunk_mooncake_master": master.address}
        config_a = _config(
            tiny_qwen2_path,
            tmp_path / "a.json",
            {**mooncake, "chunk_mooncake_segment_bytes": 256 << 20, "chunk_disk_dir": str(disk)},
            *ROUNDS,
        )
        config_b = _config(
            tiny_qwen2_path,
            tmp_path / "b.json",
            {**mooncake, "chunk_mooncake_segment_bytes": 0, "auto_chunks": True},
        )
        servers = [(config_a, tmp_path / "a.log"), (config_b, tmp_path / "b.log")]
        with running_servers(servers) as (a, b):
            ids = [_register(a.url, text)["id"] for text in DOCUMENTS]
            fused, normal = _exact(a.url, _prompt(ORDERS[0]))
            info = _info(fused)
            assert info["fused"] and info["chunks_hit"] == 3 and info["tokens_reused"] == 0, info
            assert info["tp_ranks_agree"] == 2 and info["prefill_rounds"] >= 3, info
            _assert_same_answer(fused, normal)
            fusion = requests.get(a.url + "/server_info", timeout=30).json()["internal_states"][0]
            check = fusion["hicache_ext"]["fusion"]["model_check"]
            assert check["state"] == "passed" and check["max_relative_logit_error"] <= 1e-3, check

            # Concurrent requests, the chunks in other orders: each its own normal answer.
            flush_cache(a.url)
            prompts = [_prompt(order) for order in ORDERS]
            with ThreadPoolExecutor(len(prompts)) as pool:
                together = list(
                    pool.map(
                        lambda p: _generate(
                            a.url,
                            p,
                            fusion=True,
                            fusion_selector="full",
                            fusion_recompute_ratio=1.0,
                        ),
                        prompts,
                    )
                )
            for prompt, response in zip(prompts, together, strict=True):
                assert _info(response)["fused"], _info(response)
                flush_cache(a.url)
                _assert_same_answer(response, _generate(a.url, prompt))

            # A client that hangs up after the first token: both ranks drop the request alike.
            flush_cache(a.url)
            _hang_up(a.url, _prompt(ORDERS[2]))
            assert requests.get(a.url + "/health", timeout=60).status_code == 200

            # r = 0.15: fused, and the ranks compared the rows they recomputed before writing.
            flush_cache(a.url)
            partial = _info(
                _generate(a.url, _prompt(ORDERS[1]), fusion=True, fusion_recompute_ratio=0.15)
            )
            assert partial["fused"] and "fallback" not in partial, partial
            assert partial["tp_ranks_agree"] == 2
            assert partial["tokens_reused"] >= 0.8 * partial["chunk_tokens"], partial

            # Each rank's shard under its own name in the shared store, none under the plain one.
            shared = _chunks(a.url)["stats"]["mooncake"]
            assert shared["catalog"] is None  # off under TP: ranks would index at their own times
            namespace = shared["namespace"]
            assert namespace.endswith("-tp0of2"), namespace
            base = namespace.removesuffix("-tp0of2")
            client = MooncakeClient(MooncakeConfig(master=master.address, segment_bytes=0))
            try:
                for chunk_id in ids:
                    assert client.exists(f"hicache_ext/{base}-tp0of2/{chunk_id}")
                    assert client.exists(f"hicache_ext/{base}-tp1of2/{chunk_id}")
                    assert not client.exists(f"hicache_ext/{base}/{chunk_id}")
            finally:
                client.close()

            # B: both shards read back from the store, and the same answer as A's normal prefill.
            for text, chunk_id in zip(DOCUMENTS, ids, strict=True):
                known = _register(b.url, text)
                assert (known["id"], known["created"], known["tier"]) == (
                    chunk_id,
                    False,
                    "mooncake",
                )
            flush_cache(b.url)
            on_b = _generate(
                b.url,
                _prompt(ORDERS[0]),
                fusion=True,
                fusion_selector="full",
                fusion_recompute_ratio=1.0,
            )
            assert _info(on_b)["chunks_by_tier"] == {"mooncake": 3}, _info(on_b)
            _assert_same_answer(on_b, normal)

            # B's auto_chunks: a document it never registered, kept on first sight, fused next.
            novel = "Documents:\n" + NOVEL + QUESTION
            first = _info(_generate(b.url, novel, fusion=True, fusion_recompute_ratio=1.0))
            assert first == {"fused": False, "fallback": "no_chunk_matched"}, first
            flush_cache(b.url)
            second = _generate(
                b.url, novel, fusion=True, fusion_selector="full", fusion_recompute_ratio=1.0
            )
            assert _info(second)["fused"] and _info(second)["chunks_hit"] >= 1, _info(second)
            flush_cache(b.url)
            _assert_same_answer(second, _generate(b.url, novel))

        # A again, from its disk: every rank finds its own shard of the three chunks.
        restarted = dataclasses.replace(config_a, port=free_port())
        with running_server(restarted, tmp_path / "a2.log") as again:
            listed = {c["id"]: c["tiers"] for c in _chunks(again.url)["chunks"]}
            assert set(ids) <= set(listed) and all("disk" in listed[i] for i in ids), listed
            fused_again, normal_again = _exact(again.url, _prompt(ORDERS[0]))
            assert _info(fused_again)["chunks_hit"] == 3, _info(fused_again)
            _assert_same_answer(fused_again, normal_again)
            assert fused_again["output_ids"] == normal["output_ids"]


@pytest.mark.parametrize(
    ("flags", "refused"),
    [
        ({}, ""),
        ({"tp_size": 2}, ""),
        ({"pp_size": 2}, "--pp-size > 1"),
        ({"enable_dp_attention": True}, "--enable-dp-attention"),
        ({"ep_size": 2}, "--ep-size > 1"),
    ],
)
def test_parallelisms_fusion_cannot_run_are_refused_by_name(
    flags: dict[str, object], refused: str
) -> None:
    from sglang.srt.server_args import ServerArgs

    from sglang_hicache_ext.sglang_ext.assembly import _unsupported_parallelism

    # The fields SGLang's ServerArgs has (a rename would make the check pass silently).
    defaults = {"tp_size": 1, "pp_size": 1, "enable_dp_attention": False, "ep_size": 1}
    assert all(name in ServerArgs.__struct_fields__ for name in defaults)
    reason = _unsupported_parallelism(types.SimpleNamespace(**{**defaults, **flags}))
    assert (reason == "") if not refused else (refused in reason and "does not support" in reason)
