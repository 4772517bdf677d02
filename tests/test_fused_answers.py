"""Answers and teacher-forced logits of a prefill method (evaluation/fused_answers.py), on the
tiny random Llama: the logits it reports along a reference answer are the ones a plain forward of
prompt + reference gives, whether or not the method's own answer agrees with the reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from sglang_hicache_ext.evaluation.fused_answers import (
    greedy_along,
    kl_divergence,
    run_method,
    teacher_forced_kl,
)
from sglang_hicache_ext.evaluation.token_agreement import token_agreement
from sglang_hicache_ext.fusion.adapters.hf import HFCausalLMAdapter
from sglang_hicache_ext.fusion.precompute import precompute_chunk
from sglang_hicache_ext.fusion.request import ChunkSegment, TextSegment
from sglang_hicache_ext.fusion.selectors import make_selector

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TOKENS = 6


@pytest.fixture(scope="module")
def adapter(tiny_llama_path: Path) -> HFCausalLMAdapter:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    return HFCausalLMAdapter(model)


def _segments(adapter: HFCausalLMAdapter) -> tuple[list, list[int]]:
    generator = torch.Generator().manual_seed(3)
    head, doc_a, doc_b, question = (
        torch.randint(5, 1000, (n,), generator=generator).tolist() for n in (7, 40, 33, 9)
    )
    segments = [
        TextSegment(tuple(head)),
        ChunkSegment(precompute_chunk(adapter, doc_a)),
        ChunkSegment(precompute_chunk(adapter, doc_b)),
        TextSegment(tuple(question), question=True),
    ]
    return segments, head + doc_a + doc_b + question


def _forward_logits(adapter: HFCausalLMAdapter, ids: list[int], answer: list[int]) -> list:
    """Plain transformers forward of prompt + answer: the logits predicting each answer token."""
    with torch.inference_mode():
        logits = adapter.model(torch.tensor([ids + answer])).logits[0].float()
    return [logits[len(ids) - 1 + i] for i in range(len(answer))]


def test_full_method_is_the_forward_and_its_own_reference(adapter: HFCausalLMAdapter) -> None:
    segments, ids = _segments(adapter)
    full = run_method(adapter, segments, make_selector("full", 1.0), set(), TOKENS)
    assert len(full.answer) == TOKENS
    expected = _forward_logits(adapter, ids, list(full.answer))
    for got, want in zip(full.forced_logits, expected, strict=True):
        assert torch.allclose(got, want, atol=1e-4)
    again = run_method(adapter, segments, make_selector("full", 1.0), set(), TOKENS, full.answer)
    assert teacher_forced_kl(full, again) < 1e-9


@pytest.mark.parametrize("stop_early", [False, True])
def test_forced_logits_follow_the_reference_after_answers_diverge(
    adapter: HFCausalLMAdapter, stop_early: bool
) -> None:
    segments, ids = _segments(adapter)
    full = run_method(adapter, segments, make_selector("full", 1.0), set(), TOKENS)
    # A reference that departs from any greedy path at its second token, and (stop_early) a
    # method stopped before the reference ends: both need decoding past the shared prefix.
    reference = (full.answer[0], (full.answer[1] + 1) % 1000, *full.answer[2:])
    stop = {full.answer[0]} if stop_early else set()
    run = run_method(adapter, segments, make_selector("full", 1.0), stop, TOKENS, reference)
    assert run.answer == (full.answer[:1] if stop_early else full.answer)
    expected = _forward_logits(adapter, ids, list(reference))
    assert len(run.forced_logits) == len(reference)
    for got, want in zip(run.forced_logits, expected, strict=True):
        assert torch.allclose(got, want, atol=1e-4)


def test_reuse_diverges_from_full(adapter: HFCausalLMAdapter) -> None:
    segments, _ = _segments(adapter)
    full = run_method(adapter, segments, make_selector("full", 1.0), set(), TOKENS)
    reuse = run_method(adapter, segments, make_selector("reuse", 0.0), set(), TOKENS, full.answer)
    assert teacher_forced_kl(full, reuse) > 0
    assert kl_divergence(full.first_logits, reuse.first_logits) > 0
    assert kl_divergence(full.first_logits, full.first_logits) == pytest.approx(0, abs=1e-9)


@pytest.mark.parametrize("differs_at", [None, 0, 2])
def test_greedy_along_is_the_forwards_greedy_choice_after_each_served_token(
    adapter: HFCausalLMAdapter, differs_at: int | None
) -> None:
    # The live shadow check's measure offline: whatever was served (the full answer, or one that
    # departs from it at some token), the choices are the argmax of a plain forward of
    # prompt + served, position by position.
    segments, ids = _segments(adapter)
    full = run_method(
        adapter, segments, make_selector("full", 1.0), set(), TOKENS, keep_caches=True
    )
    served = list(full.answer)
    if differs_at is not None:
        served[differs_at] = (served[differs_at] + 7) % 1000
    expected = [int(logits.argmax()) for logits in _forward_logits(adapter, ids, served)]
    assert greedy_along(adapter, full, served) == expected
    agreement = token_agreement(served, expected)
    assert agreement.tokens == TOKENS
    if differs_at is None:
        assert agreement.token_agreement == 1.0 and agreement.first_token
    else:
        assert agreement.first_token == (differs_at != 0)
        assert agreement.agreeing <= TOKENS - 1


def test_token_agreement_refuses_a_choice_missing_for_a_served_token() -> None:
    with pytest.raises(ValueError, match="one greedy choice per served token"):
        token_agreement([1, 2, 3], [1, 2])
    assert token_agreement([5, 6, 7, 8], [5, 0, 7, 1]).token_agreement == 0.5
