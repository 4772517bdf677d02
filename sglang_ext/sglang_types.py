"""The attributes of SGLang's objects the extension uses, as `Protocol`s.

The hooks receive SGLang's objects untyped (its hook registry passes them through); typing them
with these protocols lets the type checker (`make test` runs mypy over `sglang_ext`) find every
use of an attribute the protocol does not name, and `tests/test_sglang_protocols.py` checks that
SGLang 0.5.23's classes still have each one, so a change of SGLang's API shows in one place.
Only what the extension reads or writes is named here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch


class SamplingParamsLike(Protocol):
    """`sglang.srt.sampling.sampling_params.SamplingParams`."""

    custom_params: dict[str, Any] | None


class ReqKv(Protocol):
    """`sglang.srt.managers.schedule_batch.ReqKvInfo`: where a request's KV rows live."""

    req_pool_idx: int | None


class ScheduledRequest(Protocol):
    """`sglang.srt.managers.schedule_batch.Req`: one request inside the scheduler."""

    rid: str
    origin_input_ids: list[int]
    output_ids: Sequence[int]
    sampling_params: SamplingParamsLike
    return_hidden_states: bool
    multimodal_inputs: Any
    session: Any
    prefix_len: int
    cached_tokens: int
    kv: ReqKv
    logprob_start_len: int
    skip_radix_cache_insert: bool

    def finished(self) -> bool: ...


class ForwardModeLike(Protocol):
    """`sglang.srt.model_executor.forward_batch_info.ForwardMode`."""

    def is_extend(self) -> bool: ...

    def is_mixed(self) -> bool: ...


class ExtendBatch(Protocol):
    """`sglang.srt.model_executor.forward_batch_info.ForwardBatch` of an extend (prefill)."""

    forward_mode: ForwardModeLike
    rids: list[str] | None
    input_ids: torch.Tensor
    extend_prefix_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    req_pool_indices: torch.Tensor


class ReqToTokenPool(Protocol):
    """`sglang.srt.mem_cache.memory_pool.ReqToTokenPool`: each request row's KV slots."""

    req_to_token: torch.Tensor


class ModelRunnerLike(Protocol):
    """`sglang.srt.model_executor.model_runner.ModelRunner`."""

    model: torch.nn.Module
    attn_backend: Any
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: Any


class PrefillAdderLike(Protocol):
    """`sglang.srt.managers.schedule_policy.PrefillAdder`: the prefill batch being formed."""

    can_run_list: list[ScheduledRequest]
    tree_cache: Any


class SchedulerLike(Protocol):
    """`sglang.srt.managers.scheduler.Scheduler`."""

    tree_cache: Any
