"""Rows of SGLang's KV pool in the form chunks are stored: keys rotated back to pre-RoPE.

The pool holds keys after RoPE at the positions a prompt computed them; a chunk is stored
pre-RoPE so that a later prompt can rotate it to wherever the chunk sits there. Both ways a
chunk is captured read the pool through here: a registration (`capture_chunk`) and a piece of
ordinary traffic (`auto_capture`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from sglang_hicache_ext.fusion.chunk import chunk_hash
from sglang_hicache_ext.fusion.rope import LayerRopes, unrotate_layers

if TYPE_CHECKING:
    from sglang_hicache_ext.sglang_ext.chunk_fusion.registry import ChunkRegistry

logger = logging.getLogger(__name__)


def gather_rows(buffers: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """The rows at `slots` of every layer's buffer, layer-major ([L, n, ...]), in one copy."""
    first = buffers[0]
    out = first.new_empty((len(buffers), slots.numel(), *first.shape[1:]))
    for layer, buffer in enumerate(buffers):
        torch.index_select(buffer, 0, slots, out=out[layer])
    return out


def layer_rows(kv_pool: Any, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V rows at `slots` of every layer of SGLang's KV pool as the pool holds them
    (keys after RoPE), layer-major ([L, n, H, D] each), on the pool's device."""
    layers = range(kv_pool.start_layer, kv_pool.start_layer + kv_pool.layer_num)
    keys = gather_rows([kv_pool.get_key_buffer(layer) for layer in layers], slots)
    return keys, gather_rows([kv_pool.get_value_buffer(layer) for layer in layers], slots)


def bytes_per_token(kv_pool: Any) -> int:
    """Bytes one token's K and V rows take in the pool's dtype, every layer (a chunk's dense
    rows; a codec stores fewer)."""
    layers = range(kv_pool.start_layer, kv_pool.start_layer + kv_pool.layer_num)
    buffers = [kv_pool.get_key_buffer(layer) for layer in layers]
    buffers += [kv_pool.get_value_buffer(layer) for layer in layers]
    return sum(buffer[0].numel() * buffer.element_size() for buffer in buffers)


def pre_rope_rows(
    kv_pool: Any, slots: torch.Tensor, positions: torch.Tensor, rope: LayerRopes
) -> tuple[torch.Tensor, torch.Tensor]:
    """The K rows at `slots` of SGLang's KV pool rotated back to pre-RoPE from `positions`, and
    the V rows, every layer stacked ([L, n, H, D] each), on the CPU."""
    keys, values = layer_rows(kv_pool, slots)
    # One rotation over every layer of a kind: the tables are the positions' only.
    return unrotate_layers(keys, positions.to(keys.device), rope).cpu(), values.cpu()


def capture_chunk(
    registry: ChunkRegistry,
    chunk_id: str,
    token_ids: list[int],
    kv_pool: Any,
    slots: torch.Tensor,
    codec: str | None = None,
    prefix: tuple[int, ...] = (),
) -> bool:
    """Store in `registry` the registered chunk whose K/V sit at `slots` of `kv_pool`, computed
    at positions len(prefix).. after `prefix` (empty: alone at 0..n-1), compressed by `codec`
    (on every tier) when given. False (logged, counted) when the id is not its tokens' hash."""
    if chunk_id != chunk_hash(token_ids):
        registry.failed_captures += 1
        logger.error("chunk registration %s does not match its tokens; ignored", chunk_id[:12])
        return False
    if chunk_id in registry.store:
        return True
    start = len(prefix)
    positions = torch.arange(start, start + len(token_ids), device=slots.device)
    keys, values = pre_rope_rows(kv_pool, slots, positions, registry.rope)
    return registry.store_rows(
        token_ids, list(keys.unbind(0)), list(values.unbind(0)), codec, prefix
    )
