"""Answers and fidelity of one prefill method on one prompt, against the full prefill.

A method is a selector (`full` is the normal prefill computed by the same executor). For each we
keep its greedy answer (stopped at a stop token) and the teacher-forced logits along the *full
prefill's* answer: a divergence that one early token flip does not compound. Decoding reuses the
shared prefix of both paths, so teacher forcing costs only the steps after the answers differ.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import NamedTuple

import torch

from sglang_hicache_ext.fusion.adapter import ModelAdapter
from sglang_hicache_ext.fusion.decode_eviction import (
    DEFAULT_WINDOW,
    capacity_tokens,
    evict,
    keep_whole_mask,
    kept_positions,
)
from sglang_hicache_ext.fusion.decoding import decode_step
from sglang_hicache_ext.fusion.executor import FusionJob, KVCache, fused_prefill_batch
from sglang_hicache_ext.fusion.request import Segment
from sglang_hicache_ext.fusion.selectors import Selector


class MethodRun(NamedTuple):
    """One method on one prompt.

    answer: greedy token ids (the stop token included when reached); first_logits: the prefill's
    next-token logits; forced_logits: logits predicting each token of the reference answer (the
    method's own answer when no reference was given); prefill_s: wall time of the prefill;
    caches: with `keep_caches`, the KV after the prompt and answer[:i] for every i (what
    `greedy_along` decodes other answers from).
    """

    answer: tuple[int, ...]
    first_logits: torch.Tensor
    forced_logits: tuple[torch.Tensor, ...]
    prefill_s: float
    caches: tuple[KVCache, ...] = ()
    # What the prefill told about its own fidelity (`fusion.fidelity_signals`).
    signals: dict[str, float] | None = None


def run_method(
    adapter: ModelAdapter,
    segments: Sequence[Segment],
    selector: Selector,
    stop_ids: Collection[int],
    max_tokens: int,
    reference: Sequence[int] | None = None,
    decode_capacity: float | None = None,
    context_tempering: tuple[float, float] = (1.0, 1.0),
    batch_with: Sequence[Segment] | None = None,
    keep_caches: bool = False,
) -> MethodRun:
    """Fused prefill with `selector`, greedy answer, logits along `reference` (teacher forcing).
    decode_capacity: the decode keeps this fraction of the prompt's tokens (decode eviction);
    context_tempering: the question's (temperature, scale) over the chunks (APE); batch_with:
    another prompt prefilled in the same batch (its result is dropped); keep_caches: keep the KV
    after every answer token (the full prefill's, for `greedy_along`)."""
    began = time.perf_counter()
    window = 0 if decode_capacity is None else DEFAULT_WINDOW
    temperature, scale = context_tempering
    job = FusionJob(
        segments,
        selector,
        return_kv=True,
        decode_window=window,
        context_temperature=temperature,
        context_scale=scale,
        record_signals=True,
    )
    jobs = [job] if batch_with is None else [job, FusionJob(batch_with, selector)]
    prefill = fused_prefill_batch(adapter, jobs)[0]
    prefill_s = time.perf_counter() - began
    assert prefill.kv is not None
    kv = prefill.kv
    if decode_capacity is not None:
        assert prefill.window_scores is not None
        capacity = capacity_tokens(decode_capacity, prefill.num_tokens)
        kv = evict(kv, kept_positions(prefill.window_scores, keep_whole_mask(segments), capacity))
    answer, logits, caches = _greedy(adapter, kv, prefill.logits, stop_ids, max_tokens)
    if reference is None:
        kept = tuple(caches) if keep_caches else ()
        return MethodRun(
            answer, prefill.logits, tuple(logits[: len(answer)]), prefill_s, kept, prefill.signals
        )
    # logits[i] predicts answer[i] after prompt + answer[:i]: along the reference as long as the
    # two answers agree on the tokens before i.
    forced = list(logits[: min(_common_prefix(answer, reference) + 1, len(reference))])
    kv = caches[len(forced) - 1]
    for index in range(len(forced), len(reference)):
        step_logits, kv = decode_step(adapter, kv, int(reference[index - 1]))
        forced.append(step_logits)
    return MethodRun(answer, prefill.logits, tuple(forced), prefill_s, signals=prefill.signals)


def greedy_along(adapter: ModelAdapter, full: MethodRun, served: Sequence[int]) -> list[int]:
    """The full prefill's greedy choice before each token of `served` (teacher forcing: the
    prompt, then served[:i]), decoded from the full run's caches (`keep_caches`). Where `served`
    follows the full prefill's own answer, its choices are that answer's tokens; from the first
    token that differs on, one decode step per served token."""
    if not full.caches:
        raise ValueError("the full run kept no caches (run_method(..., keep_caches=True))")
    same = _common_prefix(served, full.answer)
    choices = [int(token) for token in full.answer[: min(same + 1, len(served))]]
    if len(choices) == len(served):
        return choices
    kv = full.caches[same]
    for index in range(same + 1, len(served)):
        step_logits, kv = decode_step(adapter, kv, int(served[index - 1]))
        choices.append(int(step_logits.argmax()))
    return choices


def kl_divergence(reference: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(reference || logits) of two next-token distributions given as logits."""
    ref, log_p = reference.float().log_softmax(-1), logits.float().log_softmax(-1)
    return float((ref.exp() * (ref - log_p)).sum())


def teacher_forced_kl(reference: MethodRun, run: MethodRun) -> float:
    """Mean per-token KL to the reference along the reference's answer."""
    pairs = list(zip(reference.forced_logits, run.forced_logits, strict=True))
    return sum(kl_divergence(ref, got) for ref, got in pairs) / len(pairs)


def _greedy(
    adapter: ModelAdapter,
    kv: KVCache,
    first_logits: torch.Tensor,
    stop_ids: Collection[int],
    max_tokens: int,
) -> tuple[tuple[int, ...], list[torch.Tensor], list[KVCache]]:
    """Greedy tokens; logits[i] predicts token i; caches[i] holds the prompt and tokens[:i]."""
    logits, caches = [first_logits], [kv]
    tokens = [int(first_logits.argmax())]
    while len(tokens) < max_tokens and tokens[-1] not in stop_ids:
        step_logits, kv = decode_step(adapter, kv, tokens[-1])
        logits.append(step_logits)
        caches.append(kv)
        tokens.append(int(step_logits.argmax()))
    return tuple(tokens), logits, caches


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count
