"""Rows of SGLang's KV pool in the form chunks are stored: keys rotated back to pre-RoPE.

The pool holds keys after RoPE at the positions a prompt computed them; a chunk is stored
pre-RoPE so that a later prompt can rotate it to wherever the chunk sits there. Both ways a
chunk is captured read the pool through here: a registration (`registry.capture`) and a piece
of ordinary traffic (`auto_capture`).
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_hicache_ext.fusion.rope import RopeSpec, unrotate


def pre_rope_rows(
    kv_pool: Any, slots: torch.Tensor, positions: torch.Tensor, rope: RopeSpec
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, the K rows at `slots` of SGLang's KV pool rotated back to pre-RoPE from
    `positions`, and the V rows, on the CPU."""
    layers = range(kv_pool.start_layer, kv_pool.start_layer + kv_pool.layer_num)
    stacked = torch.stack([kv_pool.get_key_buffer(layer)[slots] for layer in layers], dim=1)
    n, num_layers, heads = stacked.shape[:3]
    # One rotation over every layer's heads ([n, L*H, D]): the tables are the positions' only.
    flat = unrotate(stacked.reshape(n, num_layers * heads, -1), positions, rope)
    keys = list(flat.reshape(stacked.shape).transpose(0, 1).contiguous().cpu().unbind(dim=0))
    values = [kv_pool.get_value_buffer(layer)[slots].cpu() for layer in layers]
    return keys, values
