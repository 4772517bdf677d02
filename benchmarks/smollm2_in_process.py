"""SmolLM2-135M-Instruct in process (no server), for the benchmarks and studies that run the fusion
executor directly: the model as an executor adapter, and the prompt of
`benchmarks/fusion_quality.py` for one question as executor segments."""

from __future__ import annotations

import random
from typing import Any

import torch

from benchmarks.fusion_quality import chatml_prompt
from benchmarks.smollm2_server import smollm2_path, smollm2_tokenizer
from sglang_hicache_ext.evaluation.hotpotqa import HotpotQAExample
from sglang_hicache_ext.fusion import precompute_chunk
from sglang_hicache_ext.fusion.adapter import ModelAdapter
from sglang_hicache_ext.fusion.adapters.hf import HFCausalLMAdapter
from sglang_hicache_ext.fusion.request import Segment
from sglang_hicache_ext.sglang_ext.chunk_fusion.chunk_matches import pinned_chunk_segments
from sglang_hicache_ext.sglang_ext.chunk_fusion.registry import ChunkRegistry


def load_smollm2(threads: int) -> tuple[Any, HFCausalLMAdapter]:
    """SmolLM2's tokenizer and executor adapter, torch limited to `threads` threads."""
    torch.set_num_threads(threads)
    return smollm2_tokenizer(), HFCausalLMAdapter.from_pretrained(str(smollm2_path()))


def question_segments(
    example: HotpotQAExample, tokenizer: Any, adapter: ModelAdapter, documents: int = 6
) -> list[Segment]:
    """Same prompt as benchmarks/fusion_quality.py: shuffled paragraphs, each a precomputed chunk."""
    paragraphs = example.context(documents)
    shuffled = random.Random(example.qid).sample(paragraphs, len(paragraphs))
    ids = tokenizer.encode(chatml_prompt(shuffled, example.question), add_special_tokens=False)
    registry = ChunkRegistry(2**31, adapter.rope_specs())
    for paragraph in paragraphs:
        tokens = tokenizer.encode(paragraph, add_special_tokens=False)
        registry.add(precompute_chunk(adapter, tokens))
    segments = pinned_chunk_segments(registry, ids).segments
    return segments
