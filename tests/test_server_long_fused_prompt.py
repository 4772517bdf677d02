"""A ~1.5K-token fused prompt over 12 chunked-prefill rounds equals the normal prefill at r = 1.

On the session's `chunked_prefill_server` (tests/conftest.py, rounds of 128 tokens), after the
concurrent traffic of tests/test_server_concurrency.py: fused, its K/V is computed in the first
round and written round by round, each continuation round counted; at r = 0 it is reused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from sglang_hicache_ext.evaluation.hotpotqa import load_hotpotqa
from sglang_hicache_ext.sglang_ext.server.launcher import ServerConfig
from tests.conftest import CHUNKED_PREFILL_TOKENS as CHUNKED_PREFILL
from tests.test_server_concurrency import _fused, _generate

pytestmark = pytest.mark.server


def _fusion_stats(url: str) -> dict[str, int]:
    info = requests.get(url + "/server_info", timeout=60).json()["internal_states"][0]
    return info["hicache_ext"]["fusion"]


def test_long_fused_prompt_across_rounds_equals_normal_prefill(
    chunked_prefill_server: ServerConfig, tiny_smollm2_path: Path
) -> None:
    """A ~1.5K-token prompt of 10 registered paragraphs at 128-token rounds: fused (computed in
    the first round, written round by round), and at r = 1 the normal prefill's tokens."""
    from transformers import AutoTokenizer

    url = chunked_prefill_server.url
    docs = [d for example in load_hotpotqa(4, seed=31) for d in example.documents][:10]
    for doc in docs:
        assert requests.post(url + "/chunks", json={"text": doc}, timeout=300).status_code == 200
    prompt = "Split check.\n" + "\n\n".join(docs[::-1]) + "\nWhich is the oldest?\nA:"
    tokens = len(AutoTokenizer.from_pretrained(str(tiny_smollm2_path)).encode(prompt))
    assert tokens >= 1200
    before = _fusion_stats(url)
    fused = _generate(url, prompt, _fused("full"))
    (info,) = fused["meta_info"]["hicache_ext_fusion"]
    assert info["fused"] and info["chunks_hit"] == 10
    assert info["prefill_rounds"] >= tokens // CHUNKED_PREFILL
    after = _fusion_stats(url)
    assert not {k for k in after if k.startswith("fallback_") and after[k] != before.get(k, 0)}
    assert after["fused_continuation_rounds"] - before.get("fused_continuation_rounds", 0) == (
        info["prefill_rounds"] - 1
    )
    normal = _generate(url, prompt, {})
    assert fused["output_ids"] == normal["output_ids"]
    reused = _generate(url, prompt.replace("Split check.", "Split reuse."), _fused("reuse"))
    assert reused["meta_info"]["hicache_ext_fusion"][0]["tokens_reused"] >= tokens // 2
