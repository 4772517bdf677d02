"""Fusion core alone: full vs fused prefill TTFT on random-weight Llama-3-8B-shaped models.

Default (GPU): bf16, 32 layers / 4096 hidden / 32 heads / 8 KV heads, Llama-3 RoPE scaling, at
8K/16K/32K tokens. `--small` runs a 4-layer tiny model in fp32 at 512 tokens on CPU (the test
suite runs it that way). Each request is a short system prefix, chunks that were precomputed
beforehand (not timed), and a question. TTFT = median over repeats of one prefill to the last
token's logits, after a warm-up. Results: JSON in benchmarks/results/.

Usage: python -m benchmarks.fusion_gpu [--small] [--lengths 8192 16384 32768] [--ratio 0.15]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from sglang_hicache_ext.fusion.adapters.hf import HFCausalLMAdapter
from sglang_hicache_ext.fusion.executor import fused_prefill
from sglang_hicache_ext.fusion.precompute import precompute_chunk
from sglang_hicache_ext.fusion.request import ChunkSegment, Segment, TextSegment
from sglang_hicache_ext.fusion.selectors import make_selector

RESULTS = Path(__file__).resolve().parent / "results"
MODEL_CONFIGS = Path(__file__).resolve().parent / "model_configs"
FUSED_SELECTORS = ("a3", "freq", "cacheblend", "epic", "reuse")
SYSTEM_TOKENS = 16
QUESTION_TOKENS = 32


def llama3_8b_config(small: bool) -> Any:
    from transformers import LlamaConfig

    if small:
        from scripts.prepare_models import tiny_config

        # The tests' tiny Llama: four layers, so a3/cacheblend (check layer 1) still have fused
        # layers after it.
        return tiny_config("llama", vocab_size=1024)
    architecture = json.loads((MODEL_CONFIGS / "llama3_8b.json").read_text())
    architecture.pop("_comment")
    return LlamaConfig(**architecture)


def build_adapter(small: bool, device: torch.device, dtype: torch.dtype) -> HFCausalLMAdapter:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        # Built directly on the device in the target dtype: an 8B fp32 CPU copy would not fit.
        with torch.device(device):
            model = LlamaForCausalLM(llama3_8b_config(small)).eval()
    finally:
        torch.set_default_dtype(previous)
    return HFCausalLMAdapter(model)


def build_request(
    adapter: HFCausalLMAdapter, total: int, chunk_tokens: int, vocab: int
) -> tuple[list[Segment], torch.Tensor]:
    """System prefix + precomputed chunks + question, `total` tokens in all."""
    generator = torch.Generator().manual_seed(total)
    ids = torch.randint(0, vocab, (total,), generator=generator).tolist()
    body_end = total - QUESTION_TOKENS
    segments: list[Segment] = [TextSegment(tuple(ids[:SYSTEM_TOKENS]))]
    for start in range(SYSTEM_TOKENS, body_end, chunk_tokens):
        piece = ids[start : min(start + chunk_tokens, body_end)]
        segments.append(ChunkSegment(precompute_chunk(adapter, piece)))
    segments.append(TextSegment(tuple(ids[body_end:]), question=True))
    return segments, torch.tensor(ids)


def median_seconds(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    fn()  # warm-up: kernels, allocator
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_length(
    adapter: HFCausalLMAdapter, total: int, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    vocab = adapter.model.config.vocab_size
    segments, ids = build_request(adapter, total, args.chunk_tokens, vocab)
    full = make_selector("full", 1.0)
    reference = fused_prefill(adapter, segments, full).logits
    row: dict[str, Any] = {
        "tokens": total,
        "chunk_tokens": sum(s.chunk.num_tokens for s in segments if isinstance(s, ChunkSegment)),
        "full_s": median_seconds(
            lambda: fused_prefill(adapter, segments, full), args.repeats, device
        ),
        "hf_forward_s": _hf_forward_seconds(adapter, ids.to(device), args.repeats, device),
        "fused": {},
    }
    for name in tqdm(args.selectors, desc=f"{total} tokens", leave=False, disable=None):
        selector = make_selector(name, args.ratio, sink_tokens=args.sink_tokens)
        result = fused_prefill(adapter, segments, selector)
        seconds = median_seconds(
            lambda sel=selector: fused_prefill(adapter, segments, sel), args.repeats, device
        )
        row["fused"][name] = {
            "ratio": selector.ratio,
            "ttft_s": seconds,
            "speedup_vs_full": row["full_s"] / seconds,
            "selected": int(result.selected.numel()),
            "computed_tokens_per_layer": list(result.computed_tokens),
            "max_logit_diff_vs_full": float((result.logits - reference).abs().max()),
            "top1_agrees_with_full": bool(result.logits.argmax() == reference.argmax()),
        }
    return row


def _hf_forward_seconds(
    adapter: HFCausalLMAdapter, ids: torch.Tensor, repeats: int, device: torch.device
) -> float | None:
    """The model's own forward (last-token logits) as a sanity bound for our executor."""
    model = adapter.model

    def forward() -> None:
        with torch.inference_mode():
            model(ids[None], use_cache=False, logits_to_keep=1)

    try:
        return median_seconds(forward, repeats, device)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny 4-layer fp32 model, 512 tokens")
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--chunk-tokens", type=int, default=None)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--sink-tokens", type=int, default=0, help="first tokens per chunk kept")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--selectors", nargs="+", default=list(FUSED_SELECTORS))
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    args.lengths = args.lengths or ([512] if args.small else [8192, 16384, 32768])
    args.chunk_tokens = args.chunk_tokens or (128 if args.small else 1024)
    args.repeats = args.repeats or (1 if args.small else 5)
    name = "fusion_gpu_small.json" if args.small else "fusion_gpu.json"
    args.out = args.out or RESULTS / name
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if not args.small and device.type != "cuda":
        raise SystemExit("the full-size benchmark needs a CUDA device; use --small on CPU")
    dtype = torch.float32 if args.small else torch.bfloat16
    adapter = build_adapter(args.small, device, dtype)
    report: dict[str, Any] = {
        "benchmark": "fusion_gpu",
        "small": args.small,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.machine(),
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "model": {
            "layers": adapter.shape.num_layers,
            "q_heads": adapter.shape.num_q_heads,
            "kv_heads": adapter.shape.num_kv_heads,
            "head_dim": adapter.shape.head_dim,
        },
        "ratio": args.ratio,
        "sink_tokens": args.sink_tokens,
        "repeats": args.repeats,
        "results": [],
    }
    for total in tqdm(args.lengths, desc="lengths", unit="length", disable=None):
        row = run_length(adapter, total, args, device)
        report["results"].append(row)
        fused = ", ".join(
            f"{name} {r['ttft_s'] * 1e3:.1f} ms (x{r['speedup_vs_full']:.2f})"
            for name, r in row["fused"].items()
        )
        tqdm.write(f"{total} tokens: full {row['full_s'] * 1e3:.1f} ms; {fused}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
