"""Every model family fusion serves, through a real CPU server with SGLang's own modules.

One server per family's tiny random model (`evaluation/tiny_families.py`): three documents
registered, a prompt holding them in another order fused at r = 1 is the normal prefill (the
same greedy tokens and their logprobs), at r = 0.15 it is fused with no fallback, and the live
model check passed. The gate refusing a model its adapter does not reproduce, and a model with
no adapter, are at the end.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from scripts.prepare_models import prepare
from sglang_hicache_ext.evaluation.model_paths import tiny_family_dir
from sglang_hicache_ext.evaluation.tiny_families import (
    FAMILIES,
    NOT_SERVED_ON_CPU,
    TEST_WINDOW,
    filler_documents,
)
from sglang_hicache_ext.sglang_ext.server.launcher import ServerConfig, flush_cache, running_server
from sglang_hicache_ext.sglang_ext.server.ports import free_port

pytestmark = pytest.mark.server


def _generate(url: str, prompt: str, **custom: object) -> dict:
    body = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "custom_params": custom},
        "return_logprob": True,
    }
    response = requests.post(url + "/generate", json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()


def _fusion_state(url: str) -> dict:
    info = requests.get(url + "/server_info", timeout=30).json()["internal_states"][0]
    return info["hicache_ext"]["fusion"]


def _serve(
    model: Path, workdir: Path, extra_args: tuple[str, ...] = (), **env: str
) -> Iterator[ServerConfig]:
    config = ServerConfig(
        model_path=str(model),
        port=free_port(),
        max_total_tokens=4096,
        extra_args=extra_args,
        env=env,
    )
    with running_server(config, workdir / "server.log") as running:
        yield running


@pytest.fixture(scope="module", params=sorted(set(FAMILIES) - set(NOT_SERVED_ON_CPU)))
def family_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, ServerConfig]]:
    family = request.param
    model = prepare(tiny_family_dir(family))  # waits while `make models` builds it
    yield from ((family, running) for running in _serve(model, tmp_path_factory.mktemp(family)))


def test_family_fuses_exactly(family_server: tuple[str, ServerConfig]) -> None:
    family, server = family_server
    url = server.url
    docs = filler_documents()
    for doc in docs:
        response = requests.post(url + "/chunks", json={"text": doc}, timeout=120)
        assert response.status_code == 200, response.text
    prompt = "Docs: " + "\n\n".join(docs[i] for i in (2, 0, 1)) + "\n\nQuestion: which? Answer:"
    flush_cache(url)
    fused = _generate(url, prompt, fusion=True, fusion_selector="full", fusion_recompute_ratio=1.0)
    (info,) = fused["meta_info"]["hicache_ext_fusion"]
    assert info["fused"] is True and info["chunks_hit"] == 3 and info["tokens_reused"] == 0
    assert fused["meta_info"]["prompt_tokens"] > TEST_WINDOW  # Gemma's windows are crossed
    flush_cache(url)
    normal = _generate(url, prompt)
    assert fused["output_ids"] == normal["output_ids"], family
    fused_lp = [entry[0] for entry in fused["meta_info"]["output_token_logprobs"]]
    normal_lp = [entry[0] for entry in normal["meta_info"]["output_token_logprobs"]]
    assert fused_lp == pytest.approx(normal_lp, abs=1e-4), family
    flush_cache(url)
    partial = _generate(url, prompt, fusion=True, fusion_recompute_ratio=0.15)
    (info,) = partial["meta_info"]["hicache_ext_fusion"]
    assert info["fused"] is True and "fallback" not in info
    assert info["tokens_reused"] >= 0.8 * info["chunk_tokens"]
    check = _fusion_state(url)["model_check"]
    assert check["state"] == "passed" and check["max_relative_logit_error"] <= 1e-3, check


@pytest.fixture(scope="module")
def stretched_llama(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's weights declared as `StretchedLlamaForCausalLM` (tests/fusion_gate_models)."""
    folder = tmp_path_factory.mktemp("stretched_llama")
    for item in tiny_llama_path.iterdir():
        if item.is_file():
            (folder / item.name).symlink_to(item)
    config = json.loads((tiny_llama_path / "config.json").read_text())
    config["architectures"] = ["StretchedLlamaForCausalLM"]
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_gate_switches_fusion_off_for_a_model_its_adapter_does_not_reproduce(
    stretched_llama: Path, tmp_path: Path
) -> None:
    tests_dir = Path(__file__).resolve().parent
    env = {
        "SGLANG_EXTERNAL_MODEL_PACKAGE": "fusion_gate_models",
        "PYTHONPATH": str(tests_dir),
    }
    for server in _serve(stretched_llama, tmp_path, ("--enable-metrics",), **env):
        url = server.url
        docs = filler_documents(seed=1)
        for doc in docs:
            assert (
                requests.post(url + "/chunks", json={"text": doc}, timeout=120).status_code == 200
            )
        prompt = "Docs: " + "\n\n".join(reversed(docs)) + "\n\nQuestion: which? Answer:"
        flush_cache(url)
        normal = _generate(url, prompt)
        answers = []
        for _ in range(2):  # the checked request, then one after the model was switched off
            flush_cache(url)
            fused = _generate(url, prompt, fusion=True, fusion_recompute_ratio=0.15)
            assert fused["meta_info"]["hicache_ext_fusion"] == [
                {"fused": False, "fallback": "model_check_failed"}
            ]
            answers.append(fused["output_ids"])
        assert answers == [normal["output_ids"]] * 2  # normal answers, unaffected
        state = _fusion_state(url)
        assert state["model_check"]["state"] == "failed"
        assert "relative logit error" in state["model_check"]["reason"]
        assert state["fallback_model_check_failed"] == 2
        metrics = requests.get(url + "/metrics", timeout=30).text
        assert re.search(
            r'fusion_fallbacks_total\{[^}]*reason="model_check_failed"[^}]*\} 2\.0', metrics
        )
    log = (tmp_path / "server.log").read_text()
    assert log.count("model check failed") == 1


@pytest.fixture(scope="module")
def gemma3_in_rounds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerConfig]:
    """Gemma 3 (sliding windows, two RoPE bases) prefilling in rounds of 64 tokens."""
    model = prepare(tiny_family_dir("gemma3"))
    workdir = tmp_path_factory.mktemp("gemma3_rounds")
    yield from _serve(model, workdir, ("--chunked-prefill-size", "64"))


def test_windowed_family_concurrent_and_split_by_chunked_prefill(
    gemma3_in_rounds: ServerConfig,
) -> None:
    """Three prompts (the documents in three orders), each split into 4+ prefill rounds, fused
    at r = 1 all at once: each is its own normal prefill, one by one."""
    url = gemma3_in_rounds.url
    docs = filler_documents(seed=2)
    for doc in docs:
        assert requests.post(url + "/chunks", json={"text": doc}, timeout=120).status_code == 200
    prompts = [
        "Docs: " + "\n\n".join(docs[i] for i in order) + "\n\nQuestion: which? Answer:"
        for order in ((2, 0, 1), (1, 2, 0), (0, 1, 2))
    ]
    normal = []
    for prompt in prompts:
        flush_cache(url)
        normal.append(_generate(url, prompt)["output_ids"])
    flush_cache(url)
    with ThreadPoolExecutor(len(prompts)) as pool:
        fused = list(
            pool.map(
                lambda p: _generate(
                    url, p, fusion=True, fusion_selector="full", fusion_recompute_ratio=1.0
                ),
                prompts,
            )
        )
    for out, expected in zip(fused, normal, strict=True):
        info = out["meta_info"]["hicache_ext_fusion"][-1]  # the request's last round
        assert info["fused"] is True and info["prefill_rounds"] >= 4
        assert out["output_ids"] == expected
