"""Registered chunks inside the SGLang scheduler: capture, store, index, list, delete.

A chunk is registered by a prefill-only request (`max_new_tokens=0`) whose `custom_params`
carry its id. SGLang prefills it alone at positions 0..n-1 like any prompt; when the request
is checkpointed into the tree (its KV rows are still valid then), the `hicache_ext` tree cache
reads the chunk's K/V from SGLang's KV pool, rotates K back to pre-RoPE, computes the CacheTune
frequency scores, and stores the result in the host chunk store under the content hash of the
token ids. The chunk index learns the token sequence so later prompts can find it.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any

import torch

from sglang_hicache_ext.fusion.chunk import PrecomputedChunk, chunk_hash
from sglang_hicache_ext.fusion.frequency import DEFAULT_ALPHA, frequency_scores
from sglang_hicache_ext.fusion.rope import RopeSpec, unrotate
from sglang_hicache_ext.radix.chunk_index import ChunkIndex
from sglang_hicache_ext.sglang_ext.server.prometheus_metrics import extension_metrics
from sglang_hicache_ext.tiers.chunk_store import ChunkStore, StoreFullError

logger = logging.getLogger(__name__)

REGISTER_PARAM = "hicache_ext_register_chunk"
CONTROL_PREFIX = "hicache_ext."

# Set by `POST /chunks` around its own prefill request. A request carrying REGISTER_PARAM
# without it came from a client (`/generate`, `/v1/completions`, ...) and is refused: only the
# route checks the body's size, the tokens and the rate, and only the route's auth applies.
registering_chunk: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "hicache_ext_registering_chunk", default=False
)


def registration_id(req: Any) -> str | None:
    """The chunk id a request registers, if it is a registration request."""
    params = getattr(req.sampling_params, "custom_params", None) or {}
    value = params.get(REGISTER_PARAM)
    return value if isinstance(value, str) else None


class ChunkRegistry:
    """Chunk index + host store, owned by the tree cache (one per scheduler process)."""

    def __init__(self, capacity_bytes: int, rope: RopeSpec, alpha: float = DEFAULT_ALPHA) -> None:
        self.index = ChunkIndex()
        self.store: ChunkStore[PrecomputedChunk] = ChunkStore(capacity_bytes)
        self._rope = rope
        self._alpha = alpha
        self.failed_captures = 0
        # Bumped whenever the set of registered chunks changes (admission caches its matches).
        self.generation = 0

    def capture(
        self, chunk_id: str, token_ids: list[int], kv_pool: Any, slots: torch.Tensor
    ) -> bool:
        """Store the chunk whose K/V sit at `slots` (positions 0..n-1) of `kv_pool`."""
        if chunk_id != chunk_hash(token_ids):
            self.failed_captures += 1
            logger.error("chunk registration %s does not match its tokens; ignored", chunk_id[:12])
            return False
        if chunk_id in self.store:
            return True
        positions = torch.arange(len(token_ids), device=slots.device)
        keys, values = [], []
        for layer in range(kv_pool.start_layer, kv_pool.start_layer + kv_pool.layer_num):
            post_rope = kv_pool.get_key_buffer(layer)[slots]
            keys.append(unrotate(post_rope, positions, self._rope).cpu())
            values.append(kv_pool.get_value_buffer(layer)[slots].cpu())
        scores = torch.stack(
            [
                frequency_scores(k.float(), v.float(), self._alpha)
                for k, v in zip(keys, values, strict=True)
            ]
        )
        chunk = PrecomputedChunk(
            token_ids=tuple(token_ids),
            keys=tuple(keys),
            values=tuple(values),
            freq_scores=scores,
            alpha=self._alpha,
        )
        try:
            evicted = self.store.put(chunk_id, chunk)
        except StoreFullError as err:
            self.failed_captures += 1
            logger.error("chunk %s not stored: %s", chunk_id[:12], err)
            return False
        for old in evicted:
            self.index.remove(old)
        if len(token_ids) >= self.index.anchor_tokens:
            self.index.add(chunk_id, token_ids)
        self.generation += 1
        self._report_stored_bytes()
        logger.info(
            "chunk %s registered: %d tokens, %d bytes", chunk_id[:12], len(token_ids), chunk.nbytes
        )
        return True

    @staticmethod
    def _info(chunk_id: str, chunk: PrecomputedChunk) -> dict[str, Any]:
        return {
            "id": chunk_id,
            "num_tokens": chunk.num_tokens,
            "nbytes": chunk.nbytes,
            "num_layers": chunk.num_layers,
        }

    def describe(self, chunk_id: str) -> dict[str, Any] | None:
        chunk = self.store.peek(chunk_id)
        return None if chunk is None else self._info(chunk_id, chunk)

    def _key_probe(self, chunk_id: str, layer: int, token: int) -> list[list[float]]:
        chunk = self.store.peek(chunk_id)
        if chunk is None:
            raise ValueError(f"unknown chunk {chunk_id[:12]}")
        if not (0 <= layer < chunk.num_layers and 0 <= token < chunk.num_tokens):
            raise ValueError(
                f"probe out of range: layer {layer} of {chunk.num_layers}, token {token} of {chunk.num_tokens}"
            )
        return chunk.keys[layer][token].float().tolist()

    def list(self) -> list[dict[str, Any]]:
        return [self._info(key, chunk) for key, chunk in self.store.items()]

    def delete(self, chunk_id: str) -> bool:
        """False when unknown; raises RuntimeError while a running request pins the chunk."""
        if chunk_id not in self.store:
            return False
        if not self.store.remove(chunk_id):
            raise RuntimeError(f"chunk {chunk_id[:12]} is in use by a running request; retry later")
        if chunk_id in self.index:
            self.index.remove(chunk_id)
        self.generation += 1
        self._report_stored_bytes()
        return True

    def _report_stored_bytes(self) -> None:
        if (metrics := extension_metrics()) is not None:
            metrics.chunk_stored_bytes(self.store.stats().bytes_used)

    def stats(self) -> dict[str, Any]:
        stats = self.store.stats()
        return {**stats.__dict__, "failed_captures": self.failed_captures}

    def handle_control(self, method: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        """`hicache_ext.*` control requests from the HTTP routes (via SGLang's control channel)."""
        name = method[len(CONTROL_PREFIX) :]
        if name == "list_chunks":
            return [{"chunks": self.list(), "stats": self.stats()}]
        if name == "describe_chunk":
            info = self.describe(str(body.get("id", "")))
            if info is not None and "probe_layer" in body:
                info["key_probe"] = self._key_probe(
                    str(body["id"]), int(body["probe_layer"]), int(body["probe_token"])
                )
            return [{"chunk": info}]
        if name == "delete_chunk":
            return [{"deleted": self.delete(str(body.get("id", "")))}]
        raise ValueError(f"unknown hicache_ext control method {method!r}")
