"""`--attention-backend torch_position`: torch attention that never recomputes cached tokens.

SGLang's `torch_native` extend path pads every request's queries back to the full sequence and
runs causal attention over all of it, so a prompt whose prefix is cached still pays attention
for every cached token. This backend attends only the new queries, at their global positions,
against the pooled K/V with a position-based causal mask (`sglang_hicache_ext.fusion.attention`), for
both extend and decode. Encoder, cross-attention and sliding-window layers keep SGLang's path.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from sglang_hicache_ext.fusion.attention import gather_attend
from sglang_hicache_ext.sglang_ext.chunk_fusion.decode_keep import KeptRowsTable

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

BACKEND_NAME = "torch_position"


def _make_backend_class() -> type:
    # Defined lazily so importing this module never imports SGLang's attention stack.
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    # The overrides take SGLang's arguments as they come and read them by SGLang's own names,
    # so its signatures are written once, in SGLang.
    read_extend = _CallReader(inspect.signature(TorchNativeAttnBackend._run_sdpa_forward_extend))
    read_decode = _CallReader(inspect.signature(TorchNativeAttnBackend._run_sdpa_forward_decode))

    class TorchPositionAttnBackend(TorchNativeAttnBackend):
        """TorchNativeAttnBackend whose extend/decode attend only the new queries."""

        # The decode of a fused request asked with fusion_decode_capacity attends its kept
        # prompt rows only (chunk_fusion/decode_keep.py).
        applies_kept_rows = True
        _layer = 0

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # Written by the fused forward of this backend's model runner, read by its decode.
            self.kept_rows = KeptRowsTable()

        def forward_decode(
            self, q: Any, k: Any, v: Any, layer: Any, *args: Any, **kwargs: Any
        ) -> Any:
            self._layer = _layer_index(self, layer)
            return super().forward_decode(q, k, v, layer, *args, **kwargs)

        def forward_extend(
            self, q: Any, k: Any, v: Any, layer: Any, *args: Any, **kwargs: Any
        ) -> Any:
            # A mixed batch (--enable-mixed-chunk) decodes some requests through extend.
            self._layer = _layer_index(self, layer)
            return super().forward_extend(q, k, v, layer, *args, **kwargs)

        def _run_sdpa_forward_extend(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            call = read_extend(self, args, kwargs)
            if not (call["causal"] and _plain_self_attention(call)):
                return super()._run_sdpa_forward_extend(*args, **kwargs)
            prefix_lens = call["extend_prefix_lens"].tolist()
            extend_lens = call["extend_seq_lens"].tolist()
            return _attend_new_queries(call, self, prefix_lens, extend_lens)

        def _run_sdpa_forward_decode(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            call = read_decode(self, args, kwargs)
            if not _plain_self_attention(call):
                return super()._run_sdpa_forward_decode(*args, **kwargs)
            # One new query per request, at the last position.
            prefix_lens = [seq_len - 1 for seq_len in call["seq_lens"].tolist()]
            return _attend_new_queries(call, self, prefix_lens, [1] * len(prefix_lens))

    return TorchPositionAttnBackend


class _CallReader:
    """Reads SGLang's call as `{parameter name: value}`, defaults filled in.

    Built once per signature: attention runs per layer and step, where `Signature.bind` would
    cost ~8 us a call. SGLang's methods take plain positional-or-keyword parameters only."""

    def __init__(self, signature: inspect.Signature) -> None:
        kinds = {p.kind for p in signature.parameters.values()}
        if kinds != {inspect.Parameter.POSITIONAL_OR_KEYWORD}:
            raise TypeError(f"unexpected SGLang attention signature {signature}")
        self.names = list(signature.parameters)
        self.defaults = {
            name: p.default
            for name, p in signature.parameters.items()
            if p.default is not inspect.Parameter.empty
        }

    def __call__(
        self, backend: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        call = dict(self.defaults)
        call.update(zip(self.names, (backend, *args), strict=False))
        call.update(kwargs)
        return call


def _plain_self_attention(call: Mapping[str, Any]) -> bool:
    # Encoder, cross-attention and sliding-window layers keep SGLang's path.
    return (
        call["encoder_lens"] is None
        and not call["is_cross_attn"]
        and call["sliding_window_size"] is None
    )


def _layer_index(backend: Any, layer: Any) -> int:
    # Kept rows differ per layer; SGLang's attention call does not say which layer it is.
    return int(layer.layer_id) - getattr(backend.token_to_kv_pool, "start_layer", 0)


def _attend_new_queries(
    call: Mapping[str, Any], backend: Any, prefix_lens: Sequence[int], new_lens: Sequence[int]
) -> torch.Tensor:
    """Each request's new queries (packed in order in `query`) at positions prefix_len.., over
    its pooled K/V; written into and returning `output`. A request decoding after a decode-time
    eviction reads only its kept prompt rows (`chunk_fusion/decode_keep.py`)."""
    query, output, req_to_token = call["query"], call["output"], call["req_to_token"]
    kept_rows: KeptRowsTable = backend.kept_rows
    generations = backend.req_to_token_pool.req_generation if kept_rows else None
    start = 0
    for row, prefix_len, new_len, seq_len in zip(
        call["req_pool_indices"].tolist(),
        prefix_lens,
        new_lens,
        call["seq_lens"].tolist(),
        strict=True,
    ):
        end = start + new_len
        kept = None if generations is None else kept_rows.get(row, int(generations[row]))
        if kept is not None and prefix_len >= kept.prompt_len:  # decoding past its prompt
            if new_len != 1:
                raise RuntimeError(
                    f"a request decoding over kept rows extends by {new_len} tokens; "
                    "decode-time eviction decodes one token per step"
                )
            kept_rows.decode_steps += backend._layer == 0
            output[start:end] = kept.attend(
                backend._layer,
                query[start:end],
                call["k_cache"],
                call["v_cache"],
                req_to_token[row],
                seq_len,
                call["scaling"],
            )
        else:
            output[start:end] = gather_attend(
                query[start:end],
                call["k_cache"],
                call["v_cache"],
                req_to_token[row, :seq_len],
                torch.arange(prefix_len, seq_len, device=query.device),
                call["scaling"],
            )
        start = end
    return output


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
