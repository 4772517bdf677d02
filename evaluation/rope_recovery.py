"""RoPE position recovery on a transformers model: stored pre-RoPE keys moved to new positions."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sglang_hicache_ext.fusion.adapters.hf import HFCausalLMAdapter
from sglang_hicache_ext.fusion.precompute import precompute_chunk
from sglang_hicache_ext.fusion.rope import apply_rope


def rope_recovery_errors(adapter: HFCausalLMAdapter, ids: Sequence[int], shift: int) -> list[float]:
    """Per layer: keys precomputed at 0..n-1 and rotated to +shift vs the model's own forward at
    +shift, as relative errors."""
    chunk = precompute_chunk(adapter, ids)
    positions = torch.arange(len(ids)) + shift
    with torch.inference_mode():
        cache = adapter.model(
            torch.tensor([list(ids)]), position_ids=positions[None], use_cache=True
        ).past_key_values
    errors = []
    for layer in range(adapter.shape.num_layers):
        truth = cache.layers[layer].keys[0].transpose(0, 1)
        recovered = apply_rope(chunk.keys[layer], positions, adapter.layers[layer].rope)
        errors.append(float((recovered - truth).norm() / truth.norm()))
    return errors
