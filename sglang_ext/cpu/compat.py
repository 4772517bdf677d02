"""Hooks that let SGLang 0.5.23 and its HiCache run on a CPU-only torch.

SGLang's host-memory tier assumes CUDA in three places, and one allocator helper dispatches to
a Triton kernel for any attention backend that is not `torch_native`:

1. host KV pools are allocated pinned (`cudaHostRegister`, `pin_memory=True`);
2. the `direct` I/O backend moves KV with `sgl_kernel.kvcacheio.transfer_kv_direct`, which is
   only imported on CUDA/ROCm/XPU, so on CPU the name is simply undefined;
3. storage reads allocate pinned staging pages from the pool's `pin_memory` flag;
4. `get_last_loc` uses a Triton kernel unless the backend is `torch_native`/`ascend`.

And one place where the overlap scheduler costs a CPU server time: a forward on CPU runs on the
scheduler's own thread, so the loop that processes a batch's result after launching the next
one streams a prefill's first token only after the next decode step has run (5.
`_first_token_before_next_forward`).

Each hook changes behaviour only when the tensors involved are on the CPU, so a GPU deployment
that happens to load the plugin keeps SGLang's own paths. Nothing in site-packages is edited:
the hooks go through SGLang's plugin HookRegistry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

_HOST_POOL_CLASSES = (
    "sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost",
    "sglang.srt.mem_cache.pool_host.mla.MLATokenToKVPoolHost",
)
_TRANSFER_MODULES = (
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mla",
)
# Index of `pin_memory` among the host pool constructors' positional parameters:
# (self, buffer_info, host_to_device_ratio, host_size, page_size, layout, pin_memory).
_PIN_MEMORY_INDEX = 6


def cpu_compat_needed(mode: str) -> bool:
    if mode == "on":
        return True
    if mode == "off":
        return False
    return not torch.cuda.is_available()


def transfer_kv_direct_torch(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """CPU version of `sgl_kernel.kvcacheio.transfer_kv_direct`: copy token rows per layer."""
    del page_size  # rows are per token; page alignment is the caller's invariant
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(
            f"transfer_kv_direct: {src_indices.numel()} source rows vs {dst_indices.numel()} destination rows"
        )
    src_rows = src_indices.to(torch.long)
    dst_rows = dst_indices.to(torch.long)
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst.index_copy_(0, dst_rows, src.index_select(0, src_rows).to(dst.dtype))


def _unpinned_host_pool(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """BEFORE hook on host-pool constructors: pinning needs CUDA, so turn it off on CPU."""
    if len(args) > _PIN_MEMORY_INDEX or kwargs.get("pin_memory") is False:
        return None
    kwargs["pin_memory"] = False
    return args, kwargs


def _get_last_loc_on_cpu(
    original: Callable[..., torch.Tensor], req_to_token: torch.Tensor, *args: Any
) -> torch.Tensor:
    """AROUND hook on `get_last_loc`: the Triton dispatch cannot run on CPU tensors."""
    if req_to_token.device.type != "cpu":
        return original(req_to_token, *args)
    from sglang.srt.mem_cache.allocation import get_last_loc_torch

    return get_last_loc_torch(req_to_token, *args)


def _first_token_before_next_forward(
    original: Callable[..., bool], scheduler: Any, batch: Any, last_batch: Any
) -> bool:
    """AROUND hook on `Scheduler.is_disable_overlap_for_batch`: on CPU, process a prefill's
    result (its first token) before the next forward instead of after it. Overlap gains nothing
    there (the forward blocks the scheduler's thread), and the first token would wait one decode
    step (~0.1 s for SmolLM2-135M on 2 cores). Decode steps keep SGLang's order.

    Whether the last batch was a prefill is read from the result waiting in the queue (a copy
    of the batch as it ran): when a prefill finds no running batch, SGLang makes the prefill's
    batch object the running batch and turns it to decode mode before this question, so the
    object passed as `last_batch` no longer says it was a prefill. Under data-parallel
    attention the ranks decide on the flag they share, as SGLang's own check does."""
    if original(scheduler, batch, last_batch):
        return True
    queued = scheduler.result_queue
    if scheduler.device != "cpu" or len(queued) == 0:
        return False
    ran = queued[0][0]
    if getattr(scheduler, "require_mlp_sync", False):
        return bool(ran.is_extend_in_batch)
    return bool(ran.forward_mode.is_extend())


def install(register_hook: Callable[[str, Callable[..., Any], Any], None]) -> list[str]:
    """Register the CPU hooks; returns the hooked targets (for the log line)."""
    import importlib

    from sglang.srt.plugins.hook_registry import HookType

    targets: list[str] = []
    for cls_path in _HOST_POOL_CLASSES:
        register_hook(f"{cls_path}.__init__", _unpinned_host_pool, HookType.BEFORE)
        targets.append(f"{cls_path}.__init__")
    register_hook(
        "sglang.srt.mem_cache.allocation.get_last_loc", _get_last_loc_on_cpu, HookType.AROUND
    )
    targets.append("sglang.srt.mem_cache.allocation.get_last_loc")
    overlap_choice = "sglang.srt.managers.scheduler.Scheduler.is_disable_overlap_for_batch"
    register_hook(overlap_choice, _first_token_before_next_forward, HookType.AROUND)
    targets.append(overlap_choice)
    for module_name in _TRANSFER_MODULES:
        module = importlib.import_module(module_name)
        # Only fill the gap: on CUDA/ROCm/XPU the module already bound the real kernel.
        if not hasattr(module, "transfer_kv_direct"):
            module.transfer_kv_direct = transfer_kv_direct_torch  # type: ignore[attr-defined]
            targets.append(f"{module_name}.transfer_kv_direct")
    return targets
