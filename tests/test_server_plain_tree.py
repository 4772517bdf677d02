"""`--radix-cache-backend hicache_ext` without HiCache, on a Qwen2-family model."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from sglang_hicache_ext.sglang_ext.server.launcher import (
    ServerConfig,
    flush_cache,
    free_port,
    generate,
    running_server,
)

pytestmark = pytest.mark.server


def test_hicache_ext_without_hierarchical_cache(tiny_qwen2_path: Path, tmp_path: Path) -> None:
    config = ServerConfig(model_path=str(tiny_qwen2_path), port=free_port(), max_total_tokens=4096)
    with running_server(config, log_path=tmp_path / "server.log"):
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
