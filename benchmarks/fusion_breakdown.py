"""Where a fused prefill's time goes, stage by stage, next to the normal prefill's (in process).

SmolLM2-135M-Instruct fp32 on CPU through transformers' modules (`HFCausalLMAdapter`), the
prompts of `benchmarks/fusion_speed.py` (>= 6 shuffled HotpotQA paragraphs, >= 3K tokens, every
paragraph a registered chunk; with `--new S` a share S of each prompt's paragraphs, drawn per
prompt, is not registered: new text the prefill computes). A request runs what the server's
scheduler runs for it: match the prompt against the chunk index and pin the chunks, the
executor's prefill, write the K/V into a token pool at scattered slots (as into SGLang's pool).
The executor's and the adapter's functions are wrapped with timers (nothing in them changes),
each stage charged its exclusive time:

  match      chunk index lookup of the prompt (`ChunkIndex.find`)
  load       pinning, gathering and re-rotating stored chunk KV (`executor._load_reused`)
  selection  the selector's scoring and top-k (`Selector.select`)
  recompute  embedding, norms, q/k/v, RoPE of computed tokens, o_proj, MLP, LM head
  attention  the attention op (`executor.attend`)
  overhead   KV assembly (`executor._assemble`), the pool write, and the rest (Python, layout)

A selector with scoring layers first runs the question over the reused KV (`executor.
_scoring_pass`): its own work is charged to the stages above like the prefill's, and the whole
pass is reported apart as `scoring_pass` (inclusive seconds, not added to the total twice).
Modes are `normal`, `reuse`, `full` or `<selector>[+modifiers]` as in
`benchmarks/fusion_retention.py` (`default`: the server's default), at `--ratio`.

The normal prefill is the executor over the whole prompt as text (every token computed, causal
attention), which computes what the server's normal prefill computes. Modes run interleaved per
repeat, so each ratio is measured back to back; medians over repeats, then over prompts.
`--executor FILE` measures a patched copy of fusion/executor.py instead of the installed one.

    python -m benchmarks.fusion_breakdown [--prompts 5] [--repeats 5] [--executor /tmp/x.py]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.breakdown_report import print_table, summarize
from benchmarks.code_variants import Variant, build_variants
from benchmarks.fusion_speed import build_prompts
from benchmarks.prefill_flops import DecoderShape, PrefillWork, fused_work, normal_work
from benchmarks.retention_methods import parse_method
from benchmarks.smollm2_in_process import load_smollm2
from benchmarks.smollm2_server import MODEL, RESULTS, write_json
from benchmarks.stage_timer import StageTimer
from sglang_hicache_ext.fusion import precompute_chunk
from sglang_hicache_ext.fusion.request import Segment, TextSegment, build_layout
from sglang_hicache_ext.fusion.selectors import FullSelector, Selector
from sglang_hicache_ext.radix.chunk_index import ChunkIndex
from sglang_hicache_ext.sglang_ext.chunk_fusion.chunk_matches import pinned_chunk_segments
from sglang_hicache_ext.sglang_ext.chunk_fusion.registry import ChunkRegistry
from sglang_hicache_ext.tiers.chunks.host_cache import HostChunkCache

ADAPTER_STEPS = ("embed", "attention_inputs", "attention_output", "logits", "rotate")


class Request:
    """One prompt with its chunks registered (all but a share `new` of its paragraphs, drawn
    with `seed`), and the token pool its K/V is written into."""

    def __init__(
        self,
        adapter: Any,
        tokenizer: Any,
        docs: list[str],
        prompt: str,
        new: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.ids: list[int] = tokenizer.encode(prompt)
        self.registry = ChunkRegistry(2**31, adapter.rope_specs())
        kept = len(docs) - round(new * len(docs))
        stored = random.Random(seed).sample(docs, kept) if new else docs
        for doc in stored:
            tokens = tokenizer.encode(doc, add_special_tokens=False)
            self.registry.add(precompute_chunk(adapter, tokens))
        shape, n = adapter.shape, len(self.ids)
        slots = n + 256
        self.pool_k = [
            torch.zeros(slots, shape.num_kv_heads, shape.head_dim) for _ in range(shape.num_layers)
        ]
        self.pool_v = [torch.zeros_like(k) for k in self.pool_k]
        self.loc = torch.randperm(slots, generator=torch.Generator().manual_seed(n))[:n]


def write_pool(request: Request, kv: Any) -> None:
    """What the server does with the fused K/V: every layer into the pool's slots."""
    for layer, (keys, values) in enumerate(zip(kv.keys, kv.values, strict=True)):
        request.pool_k[layer][request.loc] = keys
        request.pool_v[layer][request.loc] = values


def run_once(
    executor: ModuleType,
    adapter: Any,
    request: Request,
    normal: bool,
    selector: Selector,
    clock: Any = time.perf_counter,
    tempering: tuple[float, float] = (1.0, 1.0),
) -> tuple[float, Any]:
    """One prefill as the server runs it; returns its seconds on `clock` and the result."""
    began = clock()
    pinned: list[str] = []
    if normal:
        segments: list[Segment] = [TextSegment(tuple(request.ids))]
    else:
        segments, pinned, *_ = pinned_chunk_segments(request.registry, request.ids)
    try:
        result = executor.fused_prefill(
            adapter, segments, selector, return_kv=True, context_tempering=tempering
        )
        write_pool(request, result.kv)
    finally:
        for chunk_id in pinned:
            request.registry.unpin(chunk_id)
    return clock() - began, result


def instrument(timer: StageTimer, executor: ModuleType, adapter: Any) -> None:
    timer.wrap(ChunkIndex, "find", "match")
    timer.wrap(HostChunkCache, "pin", "load")
    # A patched executor may load and assemble in one function (`_assemble_layer`).
    for name, stage in (
        ("_load_reused", "load"),
        ("_assemble_layer", "load"),
        ("_assemble", "assemble"),
    ):
        if hasattr(executor, name):
            timer.wrap(executor, name, stage)
    timer.wrap(executor, "attend", "attention")
    timer.wrap(sys.modules[__name__], "write_pool", "pool_write")
    for step in ADAPTER_STEPS:
        # RoPE inside a load belongs to the load.
        timer.wrap(adapter, step, "recompute", inherits=step == "rotate")


def measure(
    variant: Variant, adapter: Any, request: Request, mode: str, ratio: float, timer: StageTimer
) -> tuple[dict[str, float], Any]:
    """One timed run of `mode` (a selector name, or `normal`): seconds per stage and total."""
    selector_name = mode.split("@")[0]
    normal = selector_name == "normal"
    method = None if normal else parse_method(_method_name(selector_name, ratio))
    selector = FullSelector() if method is None else method.selector
    tempering = (1.0, 1.0) if method is None else method.tempering
    selector.select = timer.timed(selector.select, "selection")  # type: ignore[method-assign]
    scoring = [0.0]
    with variant.applied(), _inclusive(variant.executor, "_scoring_pass", timer.clock, scoring):
        instrument(timer, variant.executor, adapter)
        try:
            timer.reset()
            total, result = run_once(
                variant.executor, adapter, request, normal, selector, timer.clock, tempering
            )
        finally:
            timer.restore()
    row = {"total": total, **timer.seconds}
    row["overhead_other"] = total - sum(timer.seconds.values())
    row["scoring_pass"] = scoring[0]
    return row, result


def _method_name(mode: str, ratio: float) -> str:
    return mode if mode in ("reuse", "full") else f"{mode}@{ratio}"


@contextmanager
def _inclusive(owner: Any, name: str, clock: Any, total: list[float]) -> Iterator[None]:
    """Add the inclusive seconds of `owner.name`'s calls to total[0] (if it has one)."""
    original = getattr(owner, name, None)
    if original is None:
        yield
        return

    def timed(*args: Any, **kwargs: Any) -> Any:
        began = clock()
        try:
            return original(*args, **kwargs)
        finally:
            total[0] += clock() - began

    setattr(owner, name, timed)
    try:
        yield
    finally:
        setattr(owner, name, original)


def measure_prompt(
    variants: dict[str, Variant],
    adapter: Any,
    request: Request,
    modes: list[str],
    ratio: float,
    repeats: int,
    timer: StageTimer,
) -> dict[str, dict[str, Any]]:
    samples: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    results: dict[str, Any] = {}
    for _ in range(repeats):
        for mode in modes:
            variant = variants[mode.partition("@")[2]]
            row, results[mode] = measure(variant, adapter, request, mode, ratio, timer)
            samples[mode].append(row)
    out: dict[str, dict[str, Any]] = {}
    for mode in modes:
        keys = sorted({key for row in samples[mode] for key in row})
        out[mode] = {
            "median_s": {
                k: statistics.median(row.get(k, 0.0) for row in samples[mode]) for k in keys
            },
            "totals_s": [row["total"] for row in samples[mode]],
            "work": work_of(adapter, request, mode, results[mode]).__dict__,
            # What the prefill must compute: past the last layer only the last row is read.
            "work_needed": work_of(adapter, request, mode, results[mode], 1).__dict__,
        }
    return out


def work_of(
    adapter: Any, request: Request, mode: str, result: Any, last_layer_outputs: int | None = None
) -> PrefillWork:
    shape = DecoderShape.from_config(adapter.model.config)
    n = len(request.ids)
    name = mode.split("@")[0]
    if name == "normal":
        return normal_work(shape, n)
    segments, pinned, *_ = pinned_chunk_segments(request.registry, request.ids)
    for chunk_id in pinned:
        request.registry.unpin(chunk_id)
    layout = build_layout(segments)
    active = ~layout.is_chunk
    active[-1] = True
    active[result.selected] = True
    selector = parse_method(_method_name(name, 0.5)).selector
    question = int(layout.is_question.sum()) if name == "a3" else 0
    # Layers every token is computed in (a check layer, inline scoring layers, fresh layers);
    # the scoring pass's work is not counted here (its time is, as scoring_pass).
    inline = selector.inline_scoring_layers(layout, shape.num_layers)
    checked = max(selector.check_layer or 0, max(inline, default=-1) + 1)
    full_layers = max(checked, selector.fresh_layers) or None
    return fused_work(
        shape,
        n,
        torch.nonzero(active).flatten(),
        full_layers,
        question,
        last_layer_outputs,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5, help="runs per prompt and mode")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--modes", default="normal,a3,epic,reuse")
    parser.add_argument("--min-docs", type=int, default=6)
    parser.add_argument("--min-tokens", type=int, default=3000, help="prompt length at least")
    parser.add_argument(
        "--new", type=float, default=0.0, help="share of each prompt's paragraphs not registered"
    )
    parser.add_argument("--base", default=None, help="git revision the @base modes run")
    parser.add_argument("--executor", type=Path, default=None, help="what @patched modes run")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: CPU time of the one torch thread (needs --threads 1), blind to other jobs",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "fusion_breakdown.json")
    args = parser.parse_args()
    if not 0.0 <= args.new < 1.0:
        parser.error(f"--new: a share in [0, 1), got {args.new}")
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu counts the calling thread only: use it with --threads 1")
    modes = args.modes.split(",")
    if modes[0] != "normal":
        raise SystemExit("--modes must start with normal (the ratios' denominator)")
    variants = build_variants(args.base, args.executor, Path(tempfile.mkdtemp(prefix="breakdown-")))
    tokenizer, adapter = load_smollm2(args.threads)
    prompts = build_prompts(args.prompts, args.min_docs, args.min_tokens, tokenizer)
    timer = StageTimer(time.thread_time if args.clock == "cpu" else time.perf_counter)
    per_prompt = []
    load_before = os.getloadavg()
    with torch.inference_mode():
        requests = [
            Request(adapter, tokenizer, docs, prompt, args.new, seed)
            for seed, (docs, prompt) in enumerate(prompts)
        ]
        measure_prompt(variants, adapter, requests[0], modes, args.ratio, 1, timer)  # warm-up
        for request in tqdm(requests, desc="prompts", unit="prompt", disable=None):
            measured = measure_prompt(
                variants, adapter, request, modes, args.ratio, args.repeats, timer
            )
            per_prompt.append({"prompt_tokens": len(request.ids), "modes": measured})
            tqdm.write(
                f"{len(request.ids)} tokens: "
                + "  ".join(f"{m} {statistics.median(measured[m]['totals_s']):.2f}s" for m in modes)
            )
    summary = summarize(per_prompt, modes)
    report = {
        "benchmark": "fusion_breakdown",
        "model": MODEL,
        "threads": args.threads,
        "clock": args.clock,
        "ratio": args.ratio,
        "new_share": args.new,
        "base_revision": args.base,
        "patched_executor": str(args.executor) if args.executor else None,
        "load_average_before_after": [load_before, os.getloadavg()],
        "summary": summary,
        "prompts": per_prompt,
    }
    write_json(args.out, report, indent=2)
    print_table(summary, modes)
    print(f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}; {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
