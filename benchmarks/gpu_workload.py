"""What the GPU benchmarks run and how they time it: random-weight models of real sizes
(`model_configs/`), requests of precomputed chunks over them, one call timed or profiled on the
device.

Random weights: only the shapes matter for time, and no checkpoint has to travel to the GPU
machine. A request is a short system prefix, chunks precomputed beforehand (not timed) and a
question.
"""

from __future__ import annotations

import json
import statistics
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType

from sglang_hicache_ext.fusion.adapters.hf import HFCausalLMAdapter
from sglang_hicache_ext.fusion.precompute import precompute_chunk
from sglang_hicache_ext.fusion.request import ChunkSegment, Segment, TextSegment

MODEL_CONFIGS = Path(__file__).resolve().parent / "model_configs"
SYSTEM_TOKENS = 16
QUESTION_TOKENS = 32


def build_adapter(name: str, device: torch.device, dtype: torch.dtype) -> HFCausalLMAdapter:
    from transformers import AutoConfig, AutoModelForCausalLM

    if name == "tiny_llama":
        from scripts.prepare_models import tiny_config

        # The tests' tiny Llama: four layers, so selectors with a check layer still fuse after it.
        config = tiny_config("llama", vocab_size=1024)
    else:
        architecture = json.loads((MODEL_CONFIGS / f"{name}.json").read_text())
        architecture.pop("_comment")
        config = AutoConfig.for_model(architecture.pop("model_type"), **architecture)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        # Built on the device in the target dtype: an 8B fp32 copy on the host would not fit.
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    finally:
        torch.set_default_dtype(previous)
    return HFCausalLMAdapter(model)


def build_request(
    adapter: HFCausalLMAdapter, total: int, chunk_tokens: int
) -> tuple[list[Segment], torch.Tensor]:
    """System prefix + precomputed chunks + question, `total` tokens in all."""
    generator = torch.Generator().manual_seed(total)
    vocab = adapter.model.config.vocab_size
    ids = torch.randint(0, vocab, (total,), generator=generator).tolist()
    body_end = total - QUESTION_TOKENS
    segments: list[Segment] = [TextSegment(tuple(ids[:SYSTEM_TOKENS]))]
    for start in range(SYSTEM_TOKENS, body_end, chunk_tokens):
        piece = ids[start : min(start + chunk_tokens, body_end)]
        segments.append(ChunkSegment(precompute_chunk(adapter, piece)))
    segments.append(TextSegment(tuple(ids[body_end:]), question=True))
    return segments, torch.tensor(ids)


def median_seconds(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    fn()  # warm-up: kernels, JIT, allocator
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def token_ids(segments: list[Segment]) -> list[int]:
    return [
        t
        for s in segments
        for t in (s.chunk.token_ids if isinstance(s, ChunkSegment) else s.token_ids)
    ]


def profile_call(
    fn: Callable[[], Any], device: torch.device, out: Path, label: str
) -> dict[str, float]:
    """One call under torch's profiler; the ops that took the most time, appended to
    <out>.profile.txt. Returns the call's wall time and the device's time in it (kernels,
    copies and memsets summed; work on overlapping streams counts twice): on one stream their
    gap is where a fused prefill waits on Python or on read-backs, not on the device."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    wall = time.perf_counter() - start
    averages = prof.key_averages()
    # The device rows (kernels, copies, memsets): an op's row repeats its kernels' time.
    device_s = (
        sum(e.self_device_time_total for e in averages if e.device_type == DeviceType.CUDA) / 1e6
    )
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    table = averages.table(sort_by=sort, row_limit=25)
    with out.with_suffix(".profile.txt").open("a") as file:
        file.write(
            f"== {label}: {wall * 1e3:.1f} ms under the profiler, "
            f"{device_s * 1e3:.1f} ms of it on the device\n{table}\n"
        )
    return {"wall_s": wall, "device_s": device_s}


def count_syncs(fn: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """The synchronising CUDA operations one call makes (torch's sync debug mode), by the line
    that made them: at each, Python waits for the GPU's queue to drain and the GPU then idles
    until Python launches again."""
    if device.type != "cuda":
        return {}
    sync(device)
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    places = Counter(
        f"{Path(w.filename).parent.name}/{Path(w.filename).name}:{w.lineno}"
        for w in caught
        if "synchroniz" in str(w.message)
    )
    return {"total": sum(places.values()), "by_line": dict(places.most_common(20))}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
