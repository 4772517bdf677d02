"""The acceptance checks that need the real model: SmolLM2-135M-Instruct in fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sglang_hicache_ext.evaluation.rope_recovery import rope_recovery_errors
from sglang_hicache_ext.fusion.adapters.hf import HFCausalLMAdapter
from sglang_hicache_ext.fusion.decoding import generate_greedy
from sglang_hicache_ext.fusion.precompute import precompute_chunk
from sglang_hicache_ext.fusion.request import ChunkSegment, TextSegment
from sglang_hicache_ext.fusion.rope import apply_rope
from sglang_hicache_ext.fusion.selectors import make_selector

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHIFT = 700
DOC = (
    "The Amazon river carries more water than any other river on Earth. It flows through Peru, "
    "Colombia and Brazil before reaching the Atlantic Ocean near the city of Belem."
)


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> tuple[HFCausalLMAdapter, object]:
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    return HFCausalLMAdapter(model), AutoTokenizer.from_pretrained(smollm2_path)


def test_rope_recovery_on_smollm2(smollm2: tuple) -> None:
    adapter, tokenizer = smollm2
    ids = tokenizer(DOC)["input_ids"]
    errors = rope_recovery_errors(adapter, ids, SHIFT)
    print(f"\nRoPE recovery, {len(ids)} keys moved by {SHIFT}: max rel error {max(errors):.2e}")
    assert len(errors) == 30
    assert max(errors) <= 1e-3
    # Without recovery (keys left at their precompute positions) the error is large.
    chunk = precompute_chunk(adapter, ids)
    stale = apply_rope(chunk.keys[0], torch.arange(len(ids)), adapter.rope_spec)
    moved = apply_rope(chunk.keys[0], torch.arange(len(ids)) + SHIFT, adapter.rope_spec)
    assert float((stale - moved).norm() / moved.norm()) > 0.1


def test_full_fusion_equals_forward_on_smollm2(smollm2: tuple) -> None:
    adapter, tokenizer = smollm2
    doc_a, doc_b = DOC.split(". ", 1)
    ids_a = tokenizer(doc_a + ".")["input_ids"]
    ids_b = tokenizer(" " + doc_b)["input_ids"]
    head = tokenizer("<|im_start|>user\nContext: ")["input_ids"]
    question = tokenizer("\nWhich ocean does the Amazon reach?<|im_end|>\n<|im_start|>assistant\n")[
        "input_ids"
    ]
    segments = [
        TextSegment(tuple(head)),
        ChunkSegment(precompute_chunk(adapter, ids_a)),
        ChunkSegment(precompute_chunk(adapter, ids_b)),
        TextSegment(tuple(question), question=True),
    ]
    ids = head + ids_a + ids_b + question
    steps = 4
    fused = generate_greedy(adapter, segments, make_selector("full", 1.0), max_new_tokens=steps)
    with torch.inference_mode():
        out = adapter.model.generate(
            torch.tensor([ids]),
            max_new_tokens=steps,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    reference = out.logits[0][0].float()
    diff = float((fused.first_logits - reference).abs().max())
    print(f"\nSmolLM2 full fusion (r=1), {len(ids)} tokens: max |logit diff| {diff:.2e}")
    assert diff <= 1e-3
    assert list(fused.token_ids) == out.sequences[0, len(ids) :].tolist()
