"""Exactness gate of fusion on a real model: at ratio 1 the fused prefill is the normal prefill.

For HotpotQA prompts (all paragraphs registered as chunks, shuffled): the executor with the
`full` selector (every chunk token recomputed, chunk KV loaded and re-rotated first) against
transformers' own forward of the same token ids — the same 64 greedy tokens (no stop) and
next-token logits within fp32 noise at every step; plus RoPE position recovery (keys
precomputed at 0..n-1 and rotated by +700 vs a forward at +700). `--method` gates another
method at ratio 1 (`benchmarks/fusion_retention.py` names: e.g. the default selector with its
scoring pass, on chunks computed after the prompt's prefix, `question_attention+sink8+prefix@1`).

    python -m benchmarks.fusion_exactness [--model qwen] [--prompts 3] [--method full]
-> benchmarks/results/fusion_exactness_<model>[_<method>].json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.fusion_retention import MODELS, load_model
from benchmarks.retention_chunks import question_segments
from benchmarks.retention_methods import parse_method
from benchmarks.smollm2_server import RESULTS
from sglang_hicache_ext.evaluation.fused_answers import run_method
from sglang_hicache_ext.evaluation.hotpotqa import load_hotpotqa
from sglang_hicache_ext.evaluation.rope_recovery import rope_recovery_errors
from sglang_hicache_ext.fusion.adapters.hf import HFCausalLMAdapter
from sglang_hicache_ext.fusion.request import ChunkSegment, build_layout

NEW_TOKENS = 64
SHIFT = 700


@torch.inference_mode()
def reference_greedy(
    adapter: HFCausalLMAdapter, ids: list[int]
) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' forward with its own KV cache: 64 greedy tokens and the logits before each."""
    out = adapter.model(torch.tensor([ids]), use_cache=True)
    cache, logits = out.past_key_values, out.logits[0, -1].float()
    tokens, seen = [], []
    for _ in range(NEW_TOKENS):
        seen.append(logits)
        tokens.append(int(logits.argmax()))
        out = adapter.model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[0, -1].float()
    return tokens, seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--method", default="full", help="a method at ratio 1")
    args = parser.parse_args()
    method = parse_method(args.method)
    if method.selector.ratio != 1.0:
        raise SystemExit(f"{args.method}: the exactness gate is for ratio 1")
    torch.set_num_threads(args.threads)
    tokenizer, adapter = load_model(args.model, torch.float32)
    rows = []
    for example in load_hotpotqa(args.prompts, seed=2026):
        segments = question_segments(example, tokenizer, adapter, None, method.prefix_chunks)
        layout = build_layout(segments)
        ids = layout.token_ids.tolist()
        tokens, reference = reference_greedy(adapter, ids)
        # The executor's own greedy tokens, and its logits along transformers' tokens (teacher
        # forcing, so a flip cannot hide a difference).
        fused = run_method(
            adapter, segments, method.selector, (), NEW_TOKENS, tokens, None, method.tempering
        )
        diffs = [
            float((a - b).abs().max()) for a, b in zip(reference, fused.forced_logits, strict=True)
        ]
        first = next(s for s in segments if isinstance(s, ChunkSegment)).chunk.token_ids
        rows.append(
            {
                "qid": example.qid,
                "prompt_tokens": len(ids),
                "chunks": len(layout.spans),
                "same_64_tokens": list(fused.answer) == tokens,
                "max_abs_logit_diff": max(diffs),
                "logit_range": float(max(r.max() - r.min() for r in reference)),
                "rope_recovery_max_rel_error": max(rope_recovery_errors(adapter, first, SHIFT)),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    suffix = "" if args.method == "full" else "_" + args.method.replace("@", "_r")
    out = RESULTS / f"fusion_exactness_{args.model}{suffix}.json"
    report = {"model": MODELS[args.model], "dtype": "float32", "method": args.method, "rows": rows}
    out.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if all(row["same_64_tokens"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
