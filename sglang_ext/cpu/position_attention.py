"""`--attention-backend torch_position`: torch attention that never recomputes cached tokens.

SGLang's `torch_native` extend path pads every request's queries back to the full sequence and
runs causal attention over all of it, so a prompt whose prefix is cached still pays attention
for every cached token. This backend attends only the new queries, at their global positions,
against the pooled K/V with a position-based causal mask (`sglang_hicache_ext.fusion.attention`), for
both extend and decode. Encoder, cross-attention and sliding-window layers keep SGLang's path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from sglang_hicache_ext.fusion.attention import gather_attend

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

BACKEND_NAME = "torch_position"


def _make_backend_class() -> type:
    # Defined lazily so importing this module never imports SGLang's attention stack.
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    class TorchPositionAttnBackend(TorchNativeAttnBackend):
        """TorchNativeAttnBackend whose extend/decode attend only the new queries."""

        def _run_sdpa_forward_extend(
            self,
            query: torch.Tensor,
            output: torch.Tensor,
            k_cache: torch.Tensor,
            v_cache: torch.Tensor,
            req_to_token: torch.Tensor,
            req_pool_indices: torch.Tensor,
            seq_lens: torch.Tensor,
            extend_prefix_lens: torch.Tensor,
            extend_seq_lens: torch.Tensor,
            encoder_lens: torch.Tensor | None = None,
            scaling: float | None = None,
            enable_gqa: bool = False,
            causal: bool = False,
            is_cross_attn: bool = False,
            sliding_window_size: int | None = None,
        ) -> torch.Tensor:
            if (
                encoder_lens is not None
                or is_cross_attn
                or not causal
                or sliding_window_size is not None
            ):
                return super()._run_sdpa_forward_extend(
                    query,
                    output,
                    k_cache,
                    v_cache,
                    req_to_token,
                    req_pool_indices,
                    seq_lens,
                    extend_prefix_lens,
                    extend_seq_lens,
                    encoder_lens,
                    scaling=scaling,
                    enable_gqa=enable_gqa,
                    causal=causal,
                    is_cross_attn=is_cross_attn,
                    sliding_window_size=sliding_window_size,
                )
            start = 0
            for row, prefix_len, extend_len, seq_len in zip(
                req_pool_indices.tolist(),
                extend_prefix_lens.tolist(),
                extend_seq_lens.tolist(),
                seq_lens.tolist(),
                strict=True,
            ):
                end = start + extend_len
                positions = torch.arange(prefix_len, seq_len, device=query.device)
                output[start:end] = gather_attend(
                    query[start:end],
                    k_cache,
                    v_cache,
                    req_to_token[row, :seq_len],
                    positions,
                    scaling,
                )
                start = end
            return output

        def _run_sdpa_forward_decode(
            self,
            query: torch.Tensor,
            output: torch.Tensor,
            k_cache: torch.Tensor,
            v_cache: torch.Tensor,
            req_to_token: torch.Tensor,
            req_pool_indices: torch.Tensor,
            seq_lens: torch.Tensor,
            encoder_lens: torch.Tensor | None = None,
            scaling: float | None = None,
            enable_gqa: bool = False,
            causal: bool = False,
            is_cross_attn: bool = False,
            sliding_window_size: int | None = None,
        ) -> torch.Tensor:
            if encoder_lens is not None or is_cross_attn or sliding_window_size is not None:
                return super()._run_sdpa_forward_decode(
                    query,
                    output,
                    k_cache,
                    v_cache,
                    req_to_token,
                    req_pool_indices,
                    seq_lens,
                    encoder_lens,
                    scaling=scaling,
                    enable_gqa=enable_gqa,
                    causal=causal,
                    is_cross_attn=is_cross_attn,
                    sliding_window_size=sliding_window_size,
                )
            for index, (row, seq_len) in enumerate(
                zip(req_pool_indices.tolist(), seq_lens.tolist(), strict=True)
            ):
                positions = torch.tensor([seq_len - 1], device=query.device)
                output[index : index + 1] = gather_attend(
                    query[index : index + 1],
                    k_cache,
                    v_cache,
                    req_to_token[row, :seq_len],
                    positions,
                    scaling,
                )
            return output

    return TorchPositionAttnBackend


def create_torch_position_backend(runner: ModelRunner) -> Any:
    if runner.use_mla_backend:
        raise ValueError(
            f"--attention-backend {BACKEND_NAME} supports multi-head attention models only "
            "(this model uses MLA); use torch_native"
        )
    return _make_backend_class()(runner)


def register() -> None:
    from sglang.srt.arg_groups.choices import (
        ATTENTION_BACKEND_CHOICES,
        add_attention_backend_choices,
    )
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )

    if BACKEND_NAME not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND_NAME)(create_torch_position_backend)
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
