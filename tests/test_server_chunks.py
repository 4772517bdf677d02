"""Chunk registration through the real server: capture, pre-RoPE keys, idempotency, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests
import torch

from sglang_hicache_ext.sglang_ext.server.launcher import ServerConfig, generate
from tests.conftest import CHUNKED_PREFILL_TOKENS

pytestmark = pytest.mark.server

DOCUMENT = (
    "Ed Wood is a 1994 American biographical period comedy-drama film directed and produced by "
    "Tim Burton, and starring Johnny Depp as cult filmmaker Ed Wood."
)


def _hf_pre_rope_keys(model_path: Path, token_ids: list[int]) -> list[torch.Tensor]:
    """Per-layer k_proj outputs (keys before RoPE) of a transformers forward at 0..n-1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    head_dim = model.config.head_dim
    captured: list[torch.Tensor] = []
    hooks = [
        layer.self_attn.k_proj.register_forward_hook(
            lambda _m, _i, out: captured.append(out[0].reshape(out.shape[1], -1, head_dim))
        )
        for layer in model.model.layers
    ]
    with torch.no_grad():
        model(torch.tensor([token_ids]))
    for hook in hooks:
        hook.remove()
    return captured


def _assert_probe_matches(
    url: str, chunk_id: str, reference: list[torch.Tensor], layer: int, token: int
) -> None:
    probe = requests.get(
        f"{url}/chunks/{chunk_id}",
        params={"probe_layer": layer, "probe_token": token},
        timeout=30,
    ).json()["key_probe"]
    expected = reference[layer][token]
    rel_error = (torch.tensor(probe) - expected).norm() / expected.norm()
    assert rel_error < 1e-3, (layer, token, float(rel_error))


def test_register_capture_list_delete(hicache_server, tiny_smollm2_path: Path) -> None:
    from transformers import AutoTokenizer

    url = hicache_server.url
    token_ids = AutoTokenizer.from_pretrained(tiny_smollm2_path).encode(
        DOCUMENT, add_special_tokens=False
    )

    created = requests.post(url + "/chunks", json={"text": DOCUMENT}, timeout=120).json()
    assert created["created"] is True and created["num_tokens"] == len(token_ids)
    chunk_id = created["id"]
    again = requests.post(url + "/chunks", json={"input_ids": token_ids}, timeout=120).json()
    assert again == {**created, "created": False}

    listing = requests.get(url + "/chunks", timeout=30).json()
    assert chunk_id in [c["id"] for c in listing["chunks"]]
    config = json.loads((tiny_smollm2_path / "config.json").read_text())
    layers, kv_heads = config["num_hidden_layers"], config["num_key_value_heads"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    n = len(token_ids)
    # fp32 keys and values, and a float per token and layer.
    assert created["nbytes"] == 2 * layers * n * kv_heads * head_dim * 4 + layers * n * 4

    reference = _hf_pre_rope_keys(tiny_smollm2_path, token_ids)
    for layer, token in [(0, 5), (layers // 2, n - 1), (layers - 1, 11)]:
        _assert_probe_matches(url, chunk_id, reference, layer, token)

    assert requests.delete(f"{url}/chunks/{chunk_id}", timeout=30).json()["deleted"] is True
    assert requests.delete(f"{url}/chunks/{chunk_id}", timeout=30).status_code == 404
    assert requests.get(f"{url}/chunks/{chunk_id}", timeout=30).status_code == 404


def test_documents_registered_at_once_are_each_exact(
    hicache_server, tiny_smollm2_path: Path
) -> None:
    """Registrations posted together (the frontend sends several at once, and their chunk
    lookups share control calls, so the scheduler prefills them in one batch) each store their
    own document's pre-RoPE keys, and come back in the documents' order."""
    from transformers import AutoTokenizer

    from sglang_hicache_ext.fusion.chunk import chunk_hash
    from sglang_hicache_ext.sglang_ext.frontend import register_documents

    url = hicache_server.url
    tokenizer = AutoTokenizer.from_pretrained(tiny_smollm2_path)
    documents = [
        f"{DOCUMENT} Registered together, number {i}: {'word ' * (3 * i)}" for i in range(6)
    ]
    chunks = register_documents(url, documents, in_flight=6)
    token_ids = [tokenizer.encode(d, add_special_tokens=False) for d in documents]
    assert [c.id for c in chunks] == [chunk_hash(ids) for ids in token_ids]
    assert [c.created for c in chunks] == [True] * 6
    again = register_documents(url, documents[::-1], in_flight=6)
    assert [c.id for c in again] == [c.id for c in chunks][::-1]
    assert [c.created for c in again] == [False] * 6
    for chunk, ids in zip(chunks, token_ids, strict=True):
        reference = _hf_pre_rope_keys(tiny_smollm2_path, ids)
        _assert_probe_matches(url, chunk.id, reference, len(reference) - 1, len(ids) - 1)
        assert requests.delete(f"{url}/chunks/{chunk.id}", timeout=30).status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        {"text": ""},
        {"text": "a", "input_ids": [1]},
        {"input_ids": []},
        {"input_ids": [1, "2"]},
        {"input_ids": [10**9]},
        ["not", "an", "object"],
    ],
    ids=["empty", "both", "no-tokens", "non-int", "out-of-vocab", "not-object"],
)
def test_bad_registrations_are_400_and_server_keeps_serving(hicache_server, body) -> None:
    response = requests.post(hicache_server.url + "/chunks", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]
    assert (
        generate(hicache_server.url, "Hello", max_new_tokens=2)["meta_info"]["completion_tokens"]
        == 2
    )


def test_placement_without_a_chunk_disk_is_404(hicache_server) -> None:
    response = requests.post(hicache_server.url + "/hicache_ext/placement", json={}, timeout=60)
    assert (
        response.status_code == 404
        and "needs a disk tier (chunk_disk_dir)" in response.json()["error"]
    )
    bad = requests.post(
        hicache_server.url + "/hicache_ext/placement", json={"alpha": -2}, timeout=60
    )
    assert bad.status_code == 400 and '"alpha" must be >= 0' in bad.json()["error"]
    status = requests.get(hicache_server.url + "/hicache_ext/placement", timeout=30).json()
    assert status["rounds"] == 0 and status["last"] is None


def test_probe_out_of_range_is_400(hicache_server) -> None:
    chunk = requests.post(
        hicache_server.url + "/chunks", json={"text": DOCUMENT}, timeout=120
    ).json()
    response = requests.get(
        f"{hicache_server.url}/chunks/{chunk['id']}",
        params={"probe_layer": 99, "probe_token": 0},
        timeout=30,
    )
    assert response.status_code == 400 and "out of range" in response.json()["error"]


def test_chunk_longer_than_a_prefill_round(
    chunked_prefill_server: ServerConfig, tiny_smollm2_path: Path
) -> None:
    """Chunked prefill checkpoints every round; the capture must wait for the whole chunk."""
    from transformers import AutoTokenizer

    url, rounds = chunked_prefill_server.url, CHUNKED_PREFILL_TOKENS
    text = " ".join(f"Entry {i} lists the value {i * 13 % 29} for the field." for i in range(40))
    token_ids = AutoTokenizer.from_pretrained(tiny_smollm2_path).encode(
        text, add_special_tokens=False
    )
    assert len(token_ids) > 3 * rounds
    chunk = requests.post(url + "/chunks", json={"input_ids": token_ids}, timeout=120).json()
    assert chunk["created"] is True and chunk["num_tokens"] == len(token_ids)
    reference = _hf_pre_rope_keys(tiny_smollm2_path, token_ids)
    for layer in (0, 1, len(reference) // 2, len(reference) - 1):
        # first, middle and last prefill round
        for token in (0, 2 * rounds + 40, len(token_ids) - 1):
            _assert_probe_matches(url, chunk["id"], reference, layer, token)
