"""The fused prefill with its chunks on the GPU vs in pinned host memory (`fusion.host_chunk`),
read four ways, and the share of the serial transfer that reading a layer ahead hides.

Variants, one request, the same selection: chunks on the GPU; host chunks read at the point of
use on the compute stream (serial); read a layer ahead on a copy stream, whole layers (dense) or
only the reused rows (sparse); plain host tensors, the core before the host chunk. Hidden share
= 1 - (overlapped - GPU) / (serial - GPU). Part of `benchmarks/fusion_gpu.py`'s report.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from benchmarks.gpu_workload import median_seconds, profile_call, token_ids
from sglang_hicache_ext.fusion.adapters.hf import HFCausalLMAdapter
from sglang_hicache_ext.fusion.chunk import PrecomputedChunk
from sglang_hicache_ext.fusion.executor import FusionJob, fused_prefill_batch
from sglang_hicache_ext.fusion.host_chunk import HostChunk
from sglang_hicache_ext.fusion.request import ChunkSegment, Segment
from sglang_hicache_ext.fusion.selectors import make_selector


def host_loads(
    adapter: HFCausalLMAdapter,
    segments: list[Segment],
    selector_name: str,
    ratio: float,
    args: argparse.Namespace,
    device: torch.device,
    backend: str,
) -> dict[str, Any]:
    """One row of the report: each variant's TTFT, load wait and whether its logits equal the
    GPU-resident chunks'; the transfer it adds; the bus bandwidth of a plain copy."""
    selector = make_selector(selector_name, ratio, sink_tokens=args.sink_tokens)
    pinned = {}
    for segment in segments:
        if isinstance(segment, ChunkSegment):
            chunk = segment.chunk
            assert isinstance(chunk, PrecomputedChunk)
            pinned[id(segment)] = HostChunk.hold(chunk, device).chunk

    def with_chunks(make: Callable[[PrecomputedChunk], Any]) -> list[Segment]:
        return [
            replace(s, chunk=make(pinned[id(s)])) if isinstance(s, ChunkSegment) else s
            for s in segments
        ]

    variants = {
        "gpu": (segments, True),
        "host_serial": (with_chunks(lambda c: HostChunk(c, device, side_stream=False)), False),
        "host_overlapped": (with_chunks(lambda c: HostChunk(c, device)), True),
        "host_overlapped_sparse": (with_chunks(lambda c: HostChunk(c, device, 1.0)), True),
        "host_plain": (with_chunks(lambda c: c), True),  # the core before `fusion.host_chunk`
    }
    reference = None
    row: dict[str, Any] = {"ratio": ratio, "selector": selector_name, "backend": backend}
    for name, (variant, overlap) in variants.items():
        job = FusionJob(variant, selector, return_kv=True, overlap_loads=overlap)

        def run(job: FusionJob = job) -> Any:
            return fused_prefill_batch(adapter, [job], attention_backend=backend)[0]

        result = run()
        reference = result.logits if reference is None else reference
        if not torch.equal(result.logits, reference):
            # Where the chunks live must not change a bit: a difference is a copy race.
            raise RuntimeError(f"{name}: logits differ from the GPU-resident chunks'")
        if args.profile_length == len(token_ids(segments)) and name == "host_overlapped":
            profile_call(run, device, args.out, f"{selector_name}@{ratio} {backend}, host chunks")
        row[name] = {
            "ttft_s": median_seconds(run, args.repeats, device),
            "load_wait_s": result.load_wait_s,
            "identical_to_gpu": bool(torch.equal(result.logits, reference)),
        }
    exposed = row["host_overlapped"]["ttft_s"] - row["gpu"]["ttft_s"]
    serial = row["host_serial"]["ttft_s"] - row["gpu"]["ttft_s"]
    row["serial_transfer_s"] = serial
    row["exposed_transfer_s"] = exposed
    # On the CPU there is no bus to hide: the share means nothing there.
    row["hidden_share"] = 1 - exposed / serial if serial > 0 and device.type == "cuda" else None
    chunk_bytes = sum(c.nbytes for c in pinned.values())
    row["chunk_bytes"] = chunk_bytes
    # Host -> GPU bandwidth of a plain copy of every chunk's K/V (pinned), for the projection.
    if device.type == "cuda":
        tensors = [t for c in pinned.values() for t in (*c.keys, *c.values)]
        seconds = median_seconds(
            lambda: [t.to(device, non_blocking=True) for t in tensors], args.repeats, device
        )
        row["h2d_gb_per_s"] = chunk_bytes / seconds / 1e9
    return row
