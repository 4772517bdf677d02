"""The prepared models: plain HF folders that load offline with the expected shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch


def test_smollm2_is_a_plain_hf_llama(smollm2_path: Path) -> None:
    config = json.loads((smollm2_path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama"
    assert (
        config["num_hidden_layers"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    ) == (30, 9, 3)
    rope_theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
    assert rope_theta == 100000.0
    assert (smollm2_path / "model.safetensors").stat().st_size > 100_000_000


@pytest.mark.parametrize(
    ("fixture", "model_type"), [("tiny_llama_path", "llama"), ("tiny_qwen2_path", "qwen2")]
)
def test_tiny_models_load_and_tokenize(
    request: pytest.FixtureRequest, fixture: str, model_type: str
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path: Path = request.getfixturevalue(fixture)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    assert model.config.model_type == model_type
    assert (
        model.config.num_attention_heads > model.config.num_key_value_heads
    )  # GQA, like real models
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == text
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_smollm2_tokenizer_loads_as_its_declared_class(smollm2_path: Path) -> None:
    """SGLang's loader keeps the declared GPT2Tokenizer at once (a generic TokenizersBackend is
    loaded twice more, in each process of a server start), with the chat template's ids."""
    from sglang.srt.utils.hf_transformers.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(str(smollm2_path))
    assert type(tokenizer).__name__ == "GPT2Tokenizer"
    messages = [{"role": "user", "content": "Document 1. Paris is in France.\n\nQuestion: where?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
