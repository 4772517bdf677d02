"""Every model family fusion serves, in process against transformers' own forward.

Each family's tiny random model (`evaluation/tiny_families.py`) carries what sets it apart:
per-head q/k norms, head_dim != hidden / heads, GQA, tied embeddings, MoE top-k, llama3 RoPE
scaling, Gemma's sandwich norms and softcaps, and sliding windows shorter than the prompt with
their own RoPE base. A multi-chunk prompt, chunks in another order than computed, fused at
r = 1 is the model's own forward; at r = 0.15 it reuses rows; stored keys moved to new
positions are the keys the model computes there. The same families through SGLang's own
modules and a real server: tests/test_server_model_families.py.
"""

from __future__ import annotations

import pytest
import torch

from sglang_hicache_ext.evaluation.rope_recovery import rope_recovery_errors
from sglang_hicache_ext.evaluation.tiny_families import FAMILIES, TEST_WINDOW, tiny_family_model
from sglang_hicache_ext.fusion.adapters.hf import HFCausalLMAdapter
from sglang_hicache_ext.fusion.decoding import generate_greedy
from sglang_hicache_ext.fusion.executor import fused_prefill
from sglang_hicache_ext.fusion.precompute import precompute_chunk
from sglang_hicache_ext.fusion.request import ChunkSegment, TextSegment
from sglang_hicache_ext.fusion.selectors import make_selector

ORDER = (2, 0, 1)  # the prompt's order of the three documents


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> tuple[str, HFCausalLMAdapter]:
    return request.param, HFCausalLMAdapter(tiny_family_model(request.param))


def _prompt(adapter: HFCausalLMAdapter) -> tuple[list, list[int]]:
    generator = torch.Generator().manual_seed(3)
    tokens = [
        torch.randint(2, 1000, (n,), generator=generator).tolist() for n in (5, 20, 17, 15, 8)
    ]
    prefix, docs, question = tokens[0], tokens[1:4], tokens[4]
    chunks = [precompute_chunk(adapter, doc) for doc in docs]
    segments = [
        TextSegment(tuple(prefix)),
        *(ChunkSegment(chunks[i]) for i in ORDER),
        TextSegment(tuple(question), question=True),
    ]
    return segments, prefix + sum((docs[i] for i in ORDER), []) + question


def test_full_recompute_is_the_model_forward(family: tuple[str, HFCausalLMAdapter]) -> None:
    name, adapter = family
    segments, ids = _prompt(adapter)
    assert len(ids) > TEST_WINDOW  # the sliding layers' window is crossed
    with torch.inference_mode():
        expected = adapter.model(torch.tensor([ids])).logits[0, -1].float()
    full = fused_prefill(adapter, segments, make_selector("full", 1.0))
    torch.testing.assert_close(full.logits, expected, rtol=0, atol=1e-4)
    # Decoding over the fused KV continues the model's own greedy answer.
    with torch.inference_mode():
        reference = adapter.model.generate(
            torch.tensor([ids]), max_new_tokens=4, do_sample=False, pad_token_id=0
        )[0, len(ids) :].tolist()
    answer = generate_greedy(adapter, segments, make_selector("full", 1.0), 4)
    assert list(answer.token_ids) == reference, name


def test_partial_recompute_reuses_rows(family: tuple[str, HFCausalLMAdapter]) -> None:
    _, adapter = family
    segments, _ = _prompt(adapter)
    full = fused_prefill(adapter, segments, make_selector("full", 1.0))
    part = fused_prefill(adapter, segments, make_selector("question_attention", 0.15))
    assert part.selected.numel() == round(0.15 * part.num_chunk_tokens)
    assert sum(part.computed_tokens) < sum(full.computed_tokens)
    assert not torch.allclose(part.logits, full.logits)  # reused rows are not recomputed ones


def test_rope_recovery(family: tuple[str, HFCausalLMAdapter]) -> None:
    _, adapter = family
    ids = torch.randint(2, 1000, (TEST_WINDOW - 4,), generator=torch.Generator().manual_seed(5))
    # Layer 0's keys do not depend on the tokens' positions before RoPE: recovery is exact there;
    # deeper layers' inputs do (attention saw other positions), so only layer 0 is the test.
    assert rope_recovery_errors(adapter, ids.tolist(), shift=37)[0] <= 1e-4


def test_per_layer_attention_of_the_families() -> None:
    gemma3 = HFCausalLMAdapter(tiny_family_model("gemma3"))
    windows = [layer.sliding_window for layer in gemma3.layers]
    assert windows == [TEST_WINDOW] * 5 + [None]
    # Sliding layers rotate with base 1e4, the full one with 1e6: different frequencies.
    assert gemma3.layers[0].rope is gemma3.layers[4].rope is not gemma3.layers[5].rope
    assert float(gemma3.layers[5].rope.inv_freq[-1]) < float(gemma3.layers[0].rope.inv_freq[-1])
    gemma2 = HFCausalLMAdapter(tiny_family_model("gemma2"))
    assert [layer.sliding_window for layer in gemma2.layers] == [TEST_WINDOW, None] * 2
    assert {layer.logit_cap for layer in gemma2.layers} == {50.0}
