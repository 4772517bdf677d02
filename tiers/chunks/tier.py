"""The contract of a chunk tier below host memory: the local disk (`disk_tier.py`) and the
Mooncake Store (`remote_tier.py`). `ChunkTiers` (`chunk_tiers.py`) writes each chunk to every
tier it has and reads it back from the fastest one that holds it.

A tier holds chunks by key in their stored form (`stored_forms.py`: dense rows, or compressed by
a codec). Every read is verified before it is returned, and a chunk that fails its checks is
dropped. Faults never reach the caller as exceptions: a write that fails returns False, a read
that fails (absent, unreachable, corrupt) returns None; both are logged and counted in `stats()`.
Implementations are thread-safe.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from sglang_hicache_ext.tiers.chunks.chunk_tensors import ChunkLike, ChunkTensors
from sglang_hicache_ext.tiers.chunks.codecs.base import KVCodec
from sglang_hicache_ext.tiers.chunks.header import ChunkFileHeader
from sglang_hicache_ext.tiers.chunks.stored_forms import StoredBlob, encode_stored

StatsT = TypeVar("StatsT")


def chunk_namespace(model_path: str, identity: str) -> str:
    """The subdirectory of `chunk_disk_dir` for one model: chunk KV is only valid for the model
    (and KV dtype) that computed it, and two models may share a tokenizer, hence token ids and
    content hashes. `identity` is everything that changes the KV (config, dtypes, revision)."""
    digest = hashlib.sha256(f"{model_path}\n{identity}".encode()).hexdigest()[:16]
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(model_path).name)
    return f"{name or 'model'}-{digest}"


class ChunkTier(ABC, Generic[StatsT]):
    """Stored chunks by key, below host memory; `StatsT` is what `stats()` reports."""

    # Told of every chunk that leaves the tier other than by `remove` (evicted by a budget,
    # dropped as corrupt, gone from a shared store), so an owner can forget chunks no tier holds.
    on_drop: Callable[[str], None] | None

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether the tier holds `key`, as far as this process knows (no I/O)."""

    @abstractmethod
    def header(self, key: str) -> ChunkFileHeader | None:
        """The chunk's verified header (tokens, geometry, scores) without its rows; None if
        the tier does not hold it (or it fails its checks: then it is dropped)."""

    @abstractmethod
    def get(self, key: str) -> ChunkTensors | StoredBlob | None:
        """The whole chunk, every row (or compressed layer) verified; None if absent,
        unreachable or corrupt."""

    def put(self, key: str, chunk: ChunkLike, codec: KVCodec | None = None) -> bool:
        """Store `chunk` under `key` (compressed by `codec` if given); False (logged, counted)
        if the tier does not take it."""
        return self.put_stored(key, *encode_stored(key, chunk, codec))

    @abstractmethod
    def put_stored(self, key: str, header: bytes, rows: bytes) -> bool:
        """`put` of a chunk already encoded (`stored_forms.encode_stored`): the caller encodes
        it once for every tier."""

    @abstractmethod
    def remove(self, key: str) -> bool:
        """Drop `key` (from a shared tier: for every server); False if it could not be: a local
        tier that did not hold it, a shared one that cannot be reached."""

    @abstractmethod
    def stats(self) -> StatsT:
        """The tier's occupancy and counters."""
