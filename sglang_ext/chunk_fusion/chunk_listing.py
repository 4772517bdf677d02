"""What the chunk routes read of the registry: `GET /chunks`, `GET /chunks/{id}`, `DELETE`.

The HTTP process's routes (`server/http_routes.py`) send `hicache_ext.*` control methods;
`scheduler_control.py` hands the chunk methods here (`chunk_control`), on the scheduler thread.
A listing entry says where a request would load the chunk from, every tier holding it, the form
it is read in there and the form it was registered in, and the prefix it was computed after.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_hicache_ext.sglang_ext.chunk_fusion.registry import (
    CONTROL_PREFIX,
    ChunkRegistry,
    readable,
)


def chunk_info(registry: ChunkRegistry, chunk_id: str) -> dict[str, Any] | None:
    """The listing entry of a stored chunk; None when no tier holds it."""
    summary = registry.summary(chunk_id)
    tiers = registry.store.tiers_of(chunk_id)
    if summary is None or not tiers:
        return None
    host_form = registry.host_form(chunk_id) if tiers[0] == "host" else None
    read_form = summary.codec if host_form is None else host_form
    prefix = registry.prefix_of(chunk_id) or (None, None)
    return {
        "id": chunk_id,
        "num_tokens": summary.num_tokens,
        "nbytes": summary.nbytes,
        "num_layers": summary.num_layers,
        "tier": tiers[0],  # where a request would load it from
        "tiers": tiers,
        # The form a request reads in `tier` (a placement may hold host memory's copy more
        # compressed than the registered rows the lower tiers keep); None: dense rows.
        "codec": None if read_form == "none" else read_form,
        "registered_codec": summary.codec,
        # The prefix the chunk was computed after: its token count and id ("" / 0: alone);
        # null when not recorded (a chunk this process did not register).
        "prefix_id": prefix[0],
        "prefix_tokens": prefix[1],
    }


def describe_chunk(registry: ChunkRegistry, chunk_id: str) -> dict[str, Any] | None:
    """A chunk's listing entry; a chunk another server wrote to the shared tier is indexed
    first (`ChunkRegistry.discover`)."""
    registry.discover(chunk_id)
    return chunk_info(registry, chunk_id)


def list_chunks(registry: ChunkRegistry) -> list[dict[str, Any]]:
    infos = (chunk_info(registry, key) for key in registry.store.stored_keys())
    return [info for info in infos if info is not None]


def key_probe(registry: ChunkRegistry, chunk_id: str, layer: int, token: int) -> list[list[float]]:
    """One stored pre-RoPE key row (every KV head) of a chunk, as a request would read it."""
    stored = registry.store.peek(chunk_id)
    if stored is None:
        raise ValueError(f"unknown chunk {chunk_id[:12]}")
    chunk = readable(stored)
    if not (0 <= layer < chunk.num_layers and 0 <= token < chunk.num_tokens):
        raise ValueError(
            f"probe out of range: layer {layer} of {chunk.num_layers}, token {token} of {chunk.num_tokens}"
        )
    return chunk.rows(layer, torch.tensor([token]))[0][0].float().tolist()


def chunk_control(
    registry: ChunkRegistry, method: str, body: dict[str, Any]
) -> list[dict[str, Any]]:
    """`hicache_ext.*` chunk methods of the HTTP routes (`/chunks`, placement) on the registry."""
    name = method[len(CONTROL_PREFIX) :]
    if name == "list_chunks":
        return [{"chunks": list_chunks(registry), "stats": registry.stats()}]
    if name == "describe_chunk":
        info = describe_chunk(registry, str(body.get("id", "")))
        if info is not None and "probe_layer" in body:
            info["key_probe"] = key_probe(
                registry, str(body["id"]), int(body["probe_layer"]), int(body["probe_token"])
            )
        return [{"chunk": info}]
    if name == "describe_chunks":  # the HTTP process's coalesced lookups (`ChunkLookups`)
        ids = [str(chunk_id) for chunk_id in body.get("ids", [])]
        return [{"chunks": {chunk_id: describe_chunk(registry, chunk_id) for chunk_id in ids}}]
    if name.startswith("placement."):
        return [registry.placement.handle(name[len("placement.") :], body)]
    if name == "delete_chunk":
        return [{"deleted": registry.delete(str(body.get("id", "")))}]
    raise ValueError(f"unknown hicache_ext control method {method!r}")
