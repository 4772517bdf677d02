"""End-to-end against one real SGLang 0.5.23 server on CPU with the plugin and HiCache on.

The server is `hicache_config` (tests/conftest.py) over SmolLM2's tokenizer with random weights
(`tiny_smollm2_path`): a prefix served from the host or the file tier must give the same output
ids as its first prefill, whatever the weights; the prompts are SmolLM2's lengths."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from sglang_hicache_ext.sglang_ext.server.launcher import ServerConfig, flush_cache, running_server
from tests.conftest import E2E_DEVICE_TOKENS, generate, hicache_config

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def tier_server(
    tiny_smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerConfig]:
    workdir = tmp_path_factory.mktemp("tier_server")
    with running_server(hicache_config(tiny_smollm2_path, workdir), workdir / "server.log") as up:
        yield up


def _prompt(topic: str, sentences: int = 70) -> str:
    body = " ".join(
        f"Fact {i} about {topic}: record {i * 7 % 11} was filed in year {1900 + i}."
        for i in range(sentences)
    )
    return f"{body}\nQuestion: what is the topic of these facts?\nAnswer:"


def test_plugin_is_active(tier_server) -> None:
    info = requests.get(tier_server.url + "/server_info", timeout=30).json()
    assert info["radix_cache_backend"] == "hicache_ext"
    assert info["attention_backend"] == "torch_position"
    ext = info["internal_states"][0]["hicache_ext"]
    assert ext["tree_class"] == "HiCacheExtRadixCache"
    assert ext["tree_core"] == "python"
    assert ext["hierarchical_cache"] is True
    assert ext["storage_backend"] == "file"


def test_repeat_served_from_host_tier_then_file_tier(tier_server) -> None:
    url = tier_server.url
    flush_cache(url)
    target = _prompt("the river Thames")
    first = generate(url, target, max_new_tokens=12)
    prompt_tokens = first["meta_info"]["prompt_tokens"]
    assert first["meta_info"]["cached_tokens"] == 0

    # Push the target out of the device pool: other prompts larger than the pool in total.
    filler_tokens = 0
    for topic in ("glaciers", "volcanoes", "deserts"):
        filler_tokens += generate(url, _prompt(topic), max_new_tokens=1)["meta_info"][
            "prompt_tokens"
        ]
    assert filler_tokens > E2E_DEVICE_TOKENS

    from_host = generate(url, target, max_new_tokens=12)
    details = from_host["meta_info"]["cached_tokens_details"]
    assert details["host"] > prompt_tokens // 2, details
    assert from_host["output_ids"] == first["output_ids"]

    time.sleep(2)  # write-through to the file tier is asynchronous
    flush_cache(url)  # drops the device and host tiers; the file tier stays
    from_file = generate(url, target, max_new_tokens=12)
    details = from_file["meta_info"]["cached_tokens_details"]
    assert details["storage_backend"] == "HiCacheFile"
    assert details["storage"] > prompt_tokens // 2, details
    assert details["host"] == 0 and details["device"] == 0
    assert from_file["output_ids"] == first["output_ids"]


def test_prefix_cached_repeat_is_identical_and_fast(tier_server) -> None:
    url = tier_server.url
    flush_cache(url)
    prompt = _prompt("lighthouses", sentences=120)
    cold = generate(url, prompt, max_new_tokens=16)
    warm = generate(url, prompt, max_new_tokens=16)
    assert warm["meta_info"]["cached_tokens"] >= warm["meta_info"]["prompt_tokens"] - 16
    assert warm["output_ids"] == cold["output_ids"]
