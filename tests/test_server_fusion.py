"""Chunk fusion through the real server: exactness at r=1, reuse, fallbacks, bad input, concurrency.

Mixed concurrent traffic (split prompts, logprobs, streams, aborts) is in test_server_concurrency.py.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from sglang_hicache_ext.evaluation.hotpotqa import load_hotpotqa
from sglang_hicache_ext.sglang_ext.server.launcher import flush_cache

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def rag_prompts(hicache_server) -> list[str]:
    """Three HotpotQA questions whose 6 paragraphs are registered, then shuffled in the prompt."""
    prompts = []
    for example in load_hotpotqa(3, seed=7):
        docs = list(example.documents[:6])
        for doc in docs:
            response = requests.post(
                hicache_server.url + "/chunks", json={"text": doc}, timeout=120
            )
            assert response.status_code == 200, response.text
        shuffled = [docs[i] for i in (3, 0, 5, 1, 4, 2)]
        prompts.append(
            "Documents:\n" + "\n\n".join(shuffled) + f"\n\nQuestion: {example.question}\nAnswer:"
        )
    return prompts


def _generate(url: str, prompt: str, **custom: object) -> dict:
    body = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "custom_params": custom},
    }
    response = requests.post(url + "/generate", json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()


def test_full_recompute_equals_normal_prefill(hicache_server, rag_prompts) -> None:
    url = hicache_server.url
    for prompt in rag_prompts[:2]:
        # A variant no other test sends, fused first: a fused prefill inserts nothing, while the
        # normal one puts the prompt into every tier (the file tier survives /flush_cache).
        variant = prompt.replace("Documents:", "Exactness check. Documents:")
        flush_cache(url)
        fused = _generate(
            url, variant, fusion=True, fusion_selector="full", fusion_recompute_ratio=1.0
        )
        (info,) = fused["meta_info"]["hicache_ext_fusion"]
        assert info["fused"] is True and info["chunks_hit"] == 6 and info["tokens_reused"] == 0
        flush_cache(url)
        normal = _generate(url, variant)
        assert fused["output_ids"] == normal["output_ids"]
        # The cached prefix now holds every chunk token: nothing is left to fuse.
        again = _generate(url, variant, fusion=True, fusion_selector="a3")
        assert again["meta_info"]["hicache_ext_fusion"] == [
            {"fused": False, "fallback": "prefix_cached"}
        ]
        assert again["output_ids"] == normal["output_ids"]


def test_cached_prefix_rows_are_reused_not_recomputed(hicache_server, rag_prompts) -> None:
    """A prefix-tree hit that reaches into chunk tokens: its exact rows are read from the KV
    pool, neither computed nor queried; the chunk it cuts is reused after it. At r = 1 the
    answer is the normal prefill's, with or without the cached prefix."""
    url = hicache_server.url
    prompt = rag_prompts[2].replace("Documents:", "Prefix reuse check. Documents:")
    flush_cache(url)
    alone = _generate(url, prompt, fusion=True, fusion_selector="full", fusion_recompute_ratio=1.0)
    (alone_info,) = alone["meta_info"]["hicache_ext_fusion"]
    assert alone_info["fused"] and alone_info["prefix_tokens"] == 0
    _generate(url, prompt[: len(prompt) // 3])  # a normal prefill: exact rows into the tree
    cached = _generate(url, prompt, fusion=True, fusion_selector="full", fusion_recompute_ratio=1.0)
    (info,) = cached["meta_info"]["hicache_ext_fusion"]
    assert info["fused"] and info["chunks_hit"] == 6
    assert info["prefix_tokens"] == cached["meta_info"]["cached_tokens"] > 0
    # The prefix ends inside the chunks: fewer chunk tokens are left to select from.
    assert 0 < info["chunk_tokens"] < alone_info["chunk_tokens"]
    assert info["tokens_recomputed"] == cached["meta_info"]["prompt_tokens"] - info["prefix_tokens"]
    flush_cache(url)
    normal = _generate(url, prompt)
    assert alone["output_ids"] == cached["output_ids"] == normal["output_ids"]


@pytest.mark.parametrize(
    ("selector", "ratio"), [("a3", 0.15), ("reuse", 0.0), ("epic", 0.3), ("freq", 0.15)]
)
def test_selectors_reuse_chunk_kv(hicache_server, rag_prompts, selector: str, ratio: float) -> None:
    out = _generate(
        hicache_server.url,
        rag_prompts[0],
        fusion=True,
        fusion_selector=selector,
        fusion_recompute_ratio=ratio,
    )
    (info,) = out["meta_info"]["hicache_ext_fusion"]
    assert info["chunks_hit"] == 6
    expected_recomputed_chunk_tokens = round(ratio * info["chunk_tokens"])
    recomputed_chunk_tokens = info["chunk_tokens"] - info["tokens_reused"]
    # The last prompt token is always computed, so at most one more than the budget.
    assert (
        expected_recomputed_chunk_tokens
        <= recomputed_chunk_tokens
        <= expected_recomputed_chunk_tokens + 1
    )
    assert (
        info["tokens_recomputed"]
        == out["meta_info"]["prompt_tokens"] - info["tokens_reused"] - info["prefix_tokens"]
    )
    assert len(out["output_ids"]) == 12


def test_sink_tokens_option_reaches_the_executor(hicache_server, rag_prompts) -> None:
    # The option reaches the executor and is reported; which tokens it picks is tested in process
    # (tests/test_fusion_selectors.py), and the budget stays round(ratio x chunk tokens).
    out = _generate(
        hicache_server.url,
        rag_prompts[0],
        fusion=True,
        fusion_selector="a3",
        fusion_recompute_ratio=0.05,
        fusion_sink_tokens=4,
    )
    (info,) = out["meta_info"]["hicache_ext_fusion"]
    assert info["sink_tokens"] == 4 and info["selector"] == "a3"
    assert info["chunk_tokens"] - info["tokens_reused"] in range(
        round(0.05 * info["chunk_tokens"]), round(0.05 * info["chunk_tokens"]) + 2
    )


def test_fused_kv_never_enters_the_prefix_tree(hicache_server, rag_prompts) -> None:
    url = hicache_server.url
    # A prompt no exact prefill has seen, so no tier (device, host, file) can hold it already.
    prompt = rag_prompts[1].replace("Documents:", "Documents (unseen variant):")
    flush_cache(url)
    fused = _generate(url, prompt, fusion=True, fusion_selector="reuse", fusion_recompute_ratio=0.0)
    assert fused["meta_info"]["hicache_ext_fusion"][0]["fused"] is True
    after = _generate(url, prompt)
    assert after["meta_info"]["cached_tokens"] == 0


def test_no_registered_chunk_falls_back_to_normal_prefill(hicache_server) -> None:
    prompt = "A sentence that no registered chunk contains, about lighthouses and their keepers."
    out = _generate(hicache_server.url, prompt, fusion=True)
    assert out["meta_info"]["hicache_ext_fusion"] == [
        {"fused": False, "fallback": "no_chunk_matched"}
    ]
    info = requests.get(hicache_server.url + "/server_info", timeout=30).json()["internal_states"][
        0
    ]
    assert info["hicache_ext"]["fusion"]["fallback_no_chunk_matched"] >= 1


@pytest.mark.parametrize(
    ("custom", "message"),
    [
        ({"fusion_recompute_ratio": 1.5}, "must be a number in [0, 1]"),
        ({"fusion_recompute_ratio": -0.1}, "must be a number in [0, 1]"),
        ({"fusion_selector": "magic"}, "is unknown"),
        ({"fusion": "yes"}, "must be true or false"),
        ({"fusion_shadow": "yes"}, "fusion_shadow must be true or false (or null)"),
        ({"fusion_sink_tokens": -4}, "must be an integer >= 0"),
        ({"fusion_decode_capacity": 0}, "must be in (0, 1]"),
        ({"fusion_decode_capacity": 1.5}, "must be in (0, 1]"),
        ({"fusion_decode_capacity": "half"}, "must be in (0, 1]"),
    ],
)
def test_bad_fusion_options_are_400(hicache_server, custom: dict, message: str) -> None:
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 2, "custom_params": custom}}
    response = requests.post(hicache_server.url + "/generate", json=body, timeout=60)
    assert response.status_code == 400 and message in response.text
    assert (
        _generate(hicache_server.url, "Is the server still serving?")["meta_info"][
            "completion_tokens"
        ]
        >= 1
    )


def test_concurrent_fused_requests_match_sequential(hicache_server, rag_prompts) -> None:
    url = hicache_server.url
    # 8 distinct requests (2 prompts x 4 selectors), and the first 4 sent twice: 12 at once.
    distinct = [(p, s) for p in rag_prompts[:2] for s in ("a3", "epic", "reuse", "freq")]
    jobs = distinct + distinct[:4]
    options = {"a3": 0.15, "epic": 0.3, "reuse": 0.0, "freq": 0.15}

    def run(job: tuple[str, str]) -> list[int]:
        prompt, selector = job
        return _generate(
            url,
            prompt,
            fusion=True,
            fusion_selector=selector,
            fusion_recompute_ratio=options[selector],
        )["output_ids"]

    def fused_batches() -> int:
        info = requests.get(url + "/server_info", timeout=30).json()["internal_states"][0]
        return info["hicache_ext"]["fusion"]["fused_batches"]

    one_by_one = {job: run(job) for job in distinct}
    sequential = [one_by_one[job] for job in jobs]
    before = fused_batches()
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        concurrent = list(pool.map(run, jobs))
    # Requests of one batch were computed together (fused_prefill_batch), with the same outputs.
    assert fused_batches() - before < len(jobs)
    assert concurrent == sequential


def test_frontend_program_with_fusion_options(hicache_server) -> None:
    """An sgl.function program through FusionEndpoint: documents registered, options applied."""
    from examples.rag_pipeline import ask, connect
    from sglang_hicache_ext.sglang_ext.frontend import register_documents

    example = load_hotpotqa(1, seed=21)[0]
    documents = list(example.documents[:4])
    chunks = register_documents(hicache_server.url, documents)
    assert [c.num_tokens > 0 for c in chunks] == [True] * 4
    assert register_documents(hicache_server.url, documents[:1])[0].created is False
    backend = connect(hicache_server.url)
    with backend.fusion(selector="reuse", recompute_ratio=0.0):
        fused = ask(documents[::-1], example.question, max_tokens=4)
    plain = ask(documents[::-1], example.question, max_tokens=4)
    assert fused.tokens_reused >= 0.8 * sum(c.num_tokens for c in chunks)
    assert plain.tokens_reused == 0


def test_deleting_a_chunk_under_a_running_request_is_safe(hicache_server) -> None:
    """A fused request keeps its own copy of the chunk KV after its prefill: deleting the chunk
    mid-decode is accepted and changes nothing in that request's output."""
    import json

    url = hicache_server.url
    doc = load_hotpotqa(1, seed=99)[0].documents[2]
    chunk = requests.post(url + "/chunks", json={"text": doc}, timeout=120).json()
    body = {
        "text": f"Reference:\n{doc}\nQuestion: what is this about?\nAnswer:",
        "sampling_params": {
            "max_new_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
            "custom_params": {"fusion": True, "fusion_selector": "reuse"},
        },
    }
    reference = requests.post(url + "/generate", json=body, timeout=600).json()
    assert reference["meta_info"]["hicache_ext_fusion"][0]["fused"] is True
    last = None
    with requests.post(
        url + "/generate", json={**body, "stream": True}, stream=True, timeout=600
    ) as stream:
        for line in stream.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            if last is None:  # prefill done, decoding: drop the chunk now
                deleted = requests.delete(f"{url}/chunks/{chunk['id']}", timeout=60)
                assert deleted.status_code == 200, deleted.text
            last = json.loads(line[len(b"data:") :])
    assert last is not None and last["output_ids"] == reference["output_ids"]
    again = requests.post(url + "/generate", json=body, timeout=600).json()
    assert again["meta_info"]["hicache_ext_fusion"][0].get("fallback") == "no_chunk_matched"


def test_decode_eviction_keeps_capacity_and_never_touches_other_requests(
    hicache_server, rag_prompts
) -> None:
    """fusion_decode_capacity: at 1 the decode attends every prompt row (the output of no
    eviction); at 0.25 a quarter, reported per request; the next request on the same pool row
    decodes over all its rows again (a kept set never outlives its request)."""
    url = hicache_server.url
    # A variant no other test sends: a normal prefill of it would leave it in the file tier.
    prompt = rag_prompts[1].replace("Documents:", "Decode eviction check. Documents:")
    options = {"fusion": True, "fusion_selector": "a3", "fusion_recompute_ratio": 0.15}
    plain = _generate(url, prompt, **options)
    whole = _generate(url, prompt, **options, fusion_decode_capacity=1.0)
    (info,) = whole["meta_info"]["hicache_ext_fusion"]
    tokens = whole["meta_info"]["prompt_tokens"]
    assert info.get("decode_kept_tokens") == tokens and info["decode_unused_tokens"] == 0, info
    assert whole["output_ids"] == plain["output_ids"]

    def kept_steps() -> int:
        info = requests.get(url + "/server_info", timeout=30).json()["internal_states"][0]
        return info["hicache_ext"]["fusion"]["decode_steps_over_kept_rows"]

    before = kept_steps()
    quarter = _generate(url, prompt, **options, fusion_decode_capacity=0.25)
    # Every decode step after the first token (sampled from the prefill) read kept rows only.
    assert kept_steps() - before == len(quarter["output_ids"]) - 1
    (info,) = quarter["meta_info"]["hicache_ext_fusion"]
    assert info["fused"] and info["decode_capacity"] == 0.25
    # A quarter of the prompt, or the text outside the chunks when that alone is more.
    assert -(-tokens // 4) <= info["decode_kept_tokens"] < tokens // 2, info
    assert len(quarter["output_ids"]) == 12
    # The same pool row serves the next request: it attends every row again.
    assert _generate(url, prompt, **options)["output_ids"] == plain["output_ids"]
    stats = requests.get(url + "/server_info", timeout=30).json()["internal_states"][0]
    assert stats["hicache_ext"]["fusion"]["decode_evictions"] >= 2
