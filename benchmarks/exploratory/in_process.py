"""The fusion quality benchmark's prompt for one question, as executor segments (no server)."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from fusion_quality import chatml_prompt, documents_of  # noqa: E402
from sglang_hicache_ext.evaluation.hotpotqa import HotpotQAExample  # noqa: E402
from sglang_hicache_ext.fusion import chunk_hash, precompute_chunk  # noqa: E402
from sglang_hicache_ext.fusion.adapter import ModelAdapter  # noqa: E402
from sglang_hicache_ext.fusion.request import Segment  # noqa: E402
from sglang_hicache_ext.sglang_ext.chunk_fusion.plan import pinned_chunk_segments  # noqa: E402
from sglang_hicache_ext.sglang_ext.chunk_fusion.registry import ChunkRegistry  # noqa: E402


def question_segments(
    example: HotpotQAExample, tokenizer: Any, adapter: ModelAdapter, documents: int = 6
) -> list[Segment]:
    """Same prompt as benchmarks/fusion_quality.py: shuffled paragraphs, each a precomputed chunk."""
    paragraphs = documents_of(example, documents)
    shuffled = random.Random(example.qid).sample(paragraphs, len(paragraphs))
    ids = tokenizer.encode(chatml_prompt(shuffled, example.question), add_special_tokens=False)
    registry = ChunkRegistry(2**31, adapter.rope_spec)
    for paragraph in paragraphs:
        tokens = tokenizer.encode(paragraph, add_special_tokens=False)
        registry.store.put(chunk_hash(tokens), precompute_chunk(adapter, tokens))
        registry.index.add(chunk_hash(tokens), tokens)
    segments, _ = pinned_chunk_segments(registry, ids)
    return segments
