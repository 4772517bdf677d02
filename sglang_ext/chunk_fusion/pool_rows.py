"""Rows of SGLang's KV pool in the form chunks are stored: keys rotated back to pre-RoPE.

The pool holds keys after RoPE at the positions a prompt computed them; a chunk is stored
pre-RoPE so that a later prompt can rotate it to wherever the chunk sits there. Both ways a
chunk is captured read the pool through here: a registration (`registry.capture`) and a piece
of ordinary traffic (`auto_capture`).
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_hicache_ext.fusion.rope import LayerRopes, unrotate_layers


def gather_rows(buffers: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """The rows at `slots` of every layer's buffer, layer-major ([L, n, ...]), in one copy."""
    first = buffers[0]
    out = first.new_empty((len(buffers), slots.numel(), *first.shape[1:]))
    for layer, buffer in enumerate(buffers):
        torch.index_select(buffer, 0, slots, out=out[layer])
    return out


def pre_rope_rows(
    kv_pool: Any, slots: torch.Tensor, positions: torch.Tensor, rope: LayerRopes
) -> tuple[torch.Tensor, torch.Tensor]:
    """The K rows at `slots` of SGLang's KV pool rotated back to pre-RoPE from `positions`, and
    the V rows, every layer stacked ([L, n, H, D] each), on the CPU."""
    layers = range(kv_pool.start_layer, kv_pool.start_layer + kv_pool.layer_num)
    keys = gather_rows([kv_pool.get_key_buffer(layer) for layer in layers], slots)
    values = gather_rows([kv_pool.get_value_buffer(layer) for layer in layers], slots)
    # One rotation over every layer of a kind: the tables are the positions' only.
    return unrotate_layers(keys, positions.to(keys.device), rope).cpu(), values.cpu()
