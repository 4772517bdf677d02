"""`--radix-cache-backend hicache_ext` without HiCache, on a Qwen2-family model (the session's
`tiny_qwen2_server`, tests/conftest.py)."""

from __future__ import annotations

import pytest
import requests

from sglang_hicache_ext.sglang_ext.server.launcher import ServerConfig, flush_cache, generate

pytestmark = pytest.mark.server


def test_hicache_ext_without_hierarchical_cache(tiny_qwen2_server: ServerConfig) -> None:
    config = tiny_qwen2_server
    flush_cache(config.url)  # a shared server: the "cold" request below starts from an empty tree
    ext = requests.get(config.url + "/server_info", timeout=30).json()["internal_states"][0][
        "hicache_ext"
    ]
    assert ext["tree_class"] == "HiCacheExtRadixCache"
    assert ext["hierarchical_cache"] is False and ext["storage_backend"] is None

    prompt = " ".join(f"item {i} goes to shelf {i % 7}." for i in range(120))
    cold = generate(config.url, prompt, max_new_tokens=16)
    warm = generate(config.url, prompt, max_new_tokens=16)
    assert cold["meta_info"]["cached_tokens"] == 0
    assert warm["meta_info"]["cached_tokens"] >= warm["meta_info"]["prompt_tokens"] - 16
    assert warm["output_ids"] == cold["output_ids"]

    flush_cache(config.url)
    again = generate(config.url, prompt, max_new_tokens=16)
    assert again["meta_info"]["cached_tokens"] == 0  # no lower tier to come back from
    assert again["output_ids"] == cold["output_ids"]
