"""The fidelity techniques through the real server: chunks computed after a prefix at
registration, what a fused request says of the prefixes, the new options and "auto" without a
ratio table.
"""

from __future__ import annotations

import pytest
import requests

from sglang_hicache_ext.evaluation.hotpotqa import load_hotpotqa
from sglang_hicache_ext.sglang_ext.config.settings import DEFAULT_TARGET_AGREEMENT
from sglang_hicache_ext.sglang_ext.server.launcher import flush_cache
from sglang_hicache_ext.tuning.ratio.self_tuned import CONSERVATIVE_FLOOR

pytestmark = pytest.mark.server

PREFIX = "<|im_start|>system\nAnswer from the document.<|im_end|>\n<|im_start|>user\n"
OTHER_PREFIX = "<|im_start|>system\nYou are a helpful librarian.<|im_end|>\n<|im_start|>user\n"


def _register(url: str, body: dict) -> requests.Response:
    return requests.post(url + "/chunks", json=body, timeout=120)


def _generate(url: str, prompt: str, max_tokens: int = 8, **custom: object) -> dict:
    body = {
        "text": prompt,
        "sampling_params": {
            "max_new_tokens": max_tokens,
            "temperature": 0,
            "custom_params": custom,
        },
    }
    response = requests.post(url + "/generate", json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def document() -> str:
    # A paragraph no other test registers (other tests register the first documents of seed 7).
    return load_hotpotqa(6, seed=11)[5].documents[-1]


def test_chunk_computed_after_a_prefix_is_fused_and_exact_at_ratio_one(
    hicache_server, document: str
) -> None:
    url = hicache_server.url
    created = _register(url, {"text": document, "prefix": PREFIX})
    assert created.status_code == 200, created.text
    info = created.json()
    assert info["created"] is True and info["prefix_tokens"] > 0 and info["prefix_id"]
    listed = {c["id"]: c for c in requests.get(url + "/chunks", timeout=30).json()["chunks"]}
    assert listed[info["id"]]["prefix_id"] == info["prefix_id"]
    assert listed[info["id"]]["num_tokens"] == info["num_tokens"]  # the prefix is not stored

    # Prompts put a heading between the prefix and the chunk, so the registration's own
    # prefix + chunk rows (in the tree and the file tier) never cover the chunk here.
    prompt = f"{PREFIX}Background:\n{document}\n\nQuestion: What is this document about?"
    flush_cache(url)
    fused = _generate(url, prompt, fusion=True, fusion_selector="reuse", fusion_recompute_ratio=0)
    (meta,) = fused["meta_info"]["hicache_ext_fusion"]
    assert meta["fused"] is True and meta["chunks_hit"] == 1
    assert meta["chunk_prefixes"] == {
        "same": 1,
        "other": 0,
        "alone": 0,
        "unknown": 0,
        "in_context": 0,
    }
    assert meta["tokens_reused"] == meta["chunk_tokens"] == info["num_tokens"]
    flush_cache(url)
    full = _generate(url, prompt, fusion=True, fusion_selector="full", fusion_recompute_ratio=1)
    assert full["meta_info"]["hicache_ext_fusion"][0]["fused"] is True
    flush_cache(url)
    normal = _generate(url, prompt)  # last: a normal prefill puts the prompt in every tier
    assert full["output_ids"] == normal["output_ids"]

    # Behind another prefix the chunk is still used, and the response says so.
    other = f"{OTHER_PREFIX}Documents:\n{document}\n\nQuestion: Who is named first?"
    (meta,) = _generate(url, other, fusion=True)["meta_info"]["hicache_ext_fusion"]
    assert meta["fused"] is True and meta["chunk_prefixes"]["other"] == 1


def test_registering_again_with_another_prefix_is_a_conflict(hicache_server, document: str) -> None:
    url = hicache_server.url
    first = _register(url, {"text": document, "prefix": PREFIX})
    assert first.status_code == 200, first.text
    again = _register(url, {"text": document, "prefix": PREFIX})
    assert again.status_code == 200 and again.json()["created"] is False
    for prefix in (OTHER_PREFIX, None):
        conflict = _register(url, {"text": document, "prefix": prefix})
        assert conflict.status_code == 409, conflict.text
        assert "DELETE /chunks/" in conflict.json()["error"]
    # The stored chunk is untouched by the refusals.
    described = requests.get(url + f"/chunks/{first.json()['id']}", timeout=30).json()
    assert described["prefix_id"] == first.json()["prefix_id"]
    assert described["num_tokens"] == first.json()["num_tokens"]


@pytest.mark.parametrize(
    ("prefix", "status", "message"),
    [
        (42, 400, '"prefix" must be a string, a list of token ids or null'),
        ({"text": "x"}, 400, '"prefix" must be a string'),
        ([1, "two"], 400, '"prefix" must be a list of integers'),
        ([-1], 400, "token ids must be in"),
        ("   ", 400, '"prefix" must be a non-empty string'),
        # This server's bound is its max request input length (4090), below chunk_max_tokens.
        ([7] * 40000, 413, "the prefix (the server's max request input length"),
        ([7] * 4088, 413, "the prefix and the chunk (4088 + "),
    ],
)
def test_bad_prefixes_are_refused(
    hicache_server, prefix: object, status: int, message: str
) -> None:
    response = _register(hicache_server.url, {"text": "A short document.", "prefix": prefix})
    assert response.status_code == status, response.text
    assert message in response.json()["error"]


def test_fidelity_options_reach_the_executor_and_are_reported(
    hicache_server, document: str
) -> None:
    url = hicache_server.url
    _register(url, {"text": document, "prefix": PREFIX})
    prompt = f"{PREFIX}Documents:\n{document}\n\nQuestion: Which year is mentioned?"
    flush_cache(url)
    fused = _generate(
        url,
        prompt,
        fusion=True,
        fusion_selector="question_attention",
        fusion_recompute_ratio=0.2,
        fusion_fresh_layers=2,
        fusion_context_temperature=0.9,
        fusion_context_scale=0.9,
    )
    (meta,) = fused["meta_info"]["hicache_ext_fusion"]
    assert meta["fused"] is True and meta["selector"] == "question_attention"
    assert meta["fresh_layers"] == 2 and meta["context_tempering"] == [0.9, 0.9]
    assert meta["tokens_reused"] == meta["chunk_tokens"] - round(0.2 * meta["chunk_tokens"])
    bad = requests.post(
        url + "/generate",
        json={"text": prompt, "sampling_params": {"custom_params": {"fusion_fresh_layers": -2}}},
        timeout=60,
    )
    assert bad.status_code == 400 and "fusion_fresh_layers" in bad.text


def test_auto_ratio_without_a_ratio_table_is_self_tuned_above_the_floor(
    hicache_server, document: str
) -> None:
    url = hicache_server.url
    _register(url, {"text": document, "prefix": PREFIX})
    flush_cache(url)
    prompt = f"{PREFIX}Documents:\n{document}\n\nQuestion: Where does it take place?"
    fused = _generate(url, prompt, fusion=True, fusion_recompute_ratio="auto")
    (meta,) = fused["meta_info"]["hicache_ext_fusion"]
    # The default token-agreement target starts each tier at its self-tuned ratio; the test
    # model has no measured quality floor and this test server runs no shadow checks of its own accord
    # (tests/server_zygote.py): the conservative floor, from host memory.
    assert meta["fused"] is True and meta["ratio_source"] == "target"
    assert meta["ratio_start"] == "self_tuned" and meta["ratio_tier"] == "host"
    assert meta["target_agreement"] == DEFAULT_TARGET_AGREEMENT
    assert meta["recompute_ratio"] == pytest.approx(CONSERVATIVE_FLOOR)
    assert meta["tier_ratio"] == pytest.approx(CONSERVATIVE_FLOOR)
    status = requests.get(url + "/server_info", timeout=30).json()
    (state,) = [s["hicache_ext"] for s in status["internal_states"] if "hicache_ext" in s]
    auto = state["fusion"]["auto_ratio"]
    assert auto["floor"] == pytest.approx(CONSERVATIVE_FLOOR)
    assert auto["compute_s_per_token_layer"] > 0  # profiled from the fused prefills it ran
