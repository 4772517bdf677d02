"""The model's fusion adapter, and the live gate that proves it exact before anything is fused.

Re-RoPE and layer-by-layer execution are fragile across architectures: an adapter that misses
what a model does (a subclass that changes its positions, a norm it does not know) would garble
every fused answer without an error. So the first batch that would be fused is first prefilled
normally, and the same prompts are fused beside it at ratio 1 (every token recomputed: the
result must be the normal prefill's). Each prompt's last logits are compared with SGLang's; on a
pass the batch is then fused as asked (its rows overwrite the normal prefill's: three prefills,
once per scheduler), on a failure the normal prefill is its answer. Beyond tolerance, fusion is
switched off for this model in this scheduler, with one log line,
`fallback: "model_check_failed"` on every later request and the counters. A model with no
adapter falls back with `no_adapter`, counted the same way. No user receives a fused answer of
an unchecked model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import Any, Literal

import torch

from sglang_hicache_ext.fusion.executor import FusionJob, fused_prefill_batch
from sglang_hicache_ext.fusion.request import Segment
from sglang_hicache_ext.fusion.request_state import KVCache
from sglang_hicache_ext.fusion.selectors import FullSelector
from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters import (
    NoAdapterError,
    adapter_for,
    supported_architectures,
)
from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.decoder import SGLangDecoderAdapter
from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.tensor_parallel import TensorParallel

logger = logging.getLogger(__name__)

CheckState = Literal["unchecked", "passed", "failed", "no_adapter"]

# Largest |fused - normal| of a prompt's last logits, relative to max(1, max |normal|): fp32
# kernels agree to ~1e-6 (different attention kernels, one summation order); half precision
# rounds each layer's activations.
TOLERANCE = MappingProxyType({torch.float32: 2e-4, torch.float16: 5e-2, torch.bfloat16: 5e-2})


def _attention_applies_logit_cap(runner: Any) -> bool:
    # SGLang's torch_native backend (the CPU's without AMX, and our torch_position on it)
    # never reads RadixAttention.logit_cap; the other backends apply it.
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    return not isinstance(getattr(runner, "attn_backend", None), TorchNativeAttnBackend)


class ModelCheck:
    """Per scheduler process: the adapter of the served model and its gate."""

    def __init__(
        self,
        build: Callable[..., SGLangDecoderAdapter] = adapter_for,
        tp: TensorParallel | None = None,
    ) -> None:
        self._build = build
        self._tp = tp or TensorParallel()
        self._adapter: SGLangDecoderAdapter | None = None
        self.state: CheckState = "unchecked"
        self.reason: str | None = None  # why fusion is off for this model
        self.max_error: float | None = None  # the check's largest relative logit error
        self.prompts_checked = 0

    def adapter(self, runner: Any) -> SGLangDecoderAdapter | None:
        """The adapter (built on first use), None when the model has none or failed its check."""
        if self._adapter is None and self.state == "unchecked":
            model = runner.model
            try:
                self._adapter = self._build(
                    model,
                    runner.model_config.hf_config,
                    applies_logit_cap=_attention_applies_logit_cap(runner),
                    tp=self._tp,
                )
            except (NoAdapterError, ValueError) as err:
                self.state, self.reason = "no_adapter", str(err)
                logger.error(
                    "fusion disabled for %s: %s (families with an adapter: %s)",
                    type(model).__name__,
                    err,
                    ", ".join(supported_architectures()),
                )
        return self._adapter if self.state in ("unchecked", "passed") else None

    @property
    def fallback(self) -> str | None:
        """The fallback reason of a request this model cannot fuse now, else None."""
        if self.state == "no_adapter":
            return "no_adapter"
        if self.state == "failed":
            return "model_check_failed"
        return None

    @property
    def pending(self) -> bool:
        return self.state == "unchecked"

    def check(
        self,
        adapter: SGLangDecoderAdapter,
        prompts: Sequence[tuple[Sequence[Segment], KVCache | None, int]],
        normal_logits: torch.Tensor,
    ) -> bool:
        """Fuse `prompts` ((segments, exact prefix, the position whose logits SGLang computed)
        at ratio 1 and compare with the normal prefill's logits [len(prompts), vocab]."""
        jobs = [
            FusionJob(segments, FullSelector(), exact_prefix=prefix, outputs_from=position)
            for segments, prefix, position in prompts
        ]
        errors: list[float] = []
        raised: str | None = None
        try:
            results = fused_prefill_batch(adapter, jobs)
            for result, normal in zip(results, normal_logits, strict=True):
                assert result.hidden is not None
                fused = adapter.logits(result.hidden[:1])[0]  # the checked position's row
                if fused.shape[0] != normal.shape[0]:
                    raise ValueError(f"{fused.shape[0]} logits, the model gives {normal.shape[0]}")
                normal = normal.float().to(fused.device)
                scale = max(1.0, float(normal.abs().max()))
                errors.append(float((fused - normal).abs().max()) / scale)
        except Exception as err:  # an adapter that cannot even run this model: off, not down
            raised = f"the fused prefill raised {type(err).__name__}: {err}"
        tolerance = TOLERANCE.get(adapter.dtype, 5e-2)
        passed = raised is None and max(errors) <= tolerance
        # Every rank compares the same gathered logits; should one rank still judge otherwise
        # (or raise after the prefill's last collective), fusion goes off on all of them: ranks
        # that fused alone would wait on each other.
        if not adapter.tp.agree(f"model check passed: {passed}"):
            return self._fail(raised or "the tensor-parallel ranks judged the check differently")
        if raised is not None:
            return self._fail(raised)
        self.max_error = max(errors)
        self.prompts_checked = len(errors)
        if passed:
            self.state = "passed"
            logger.info(
                "fusion: model check passed (%d prompt(s), largest relative logit error %.2e "
                "at ratio 1, tolerance %.0e)",
                len(errors),
                self.max_error,
                tolerance,
            )
            return True
        return self._fail(
            f"fused prefill at ratio 1 differs from the normal prefill: relative logit error "
            f"{self.max_error:.3g} > {tolerance:.0e}"
        )

    def _fail(self, reason: str) -> bool:
        self.state, self.reason, self._adapter = "failed", reason, None
        logger.error("fusion disabled for this model: model check failed (%s)", reason)
        return False

    def stats(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "reason": self.reason,
            "max_relative_logit_error": self.max_error,
            "prompts_checked": self.prompts_checked,
        }
