"""A chunk served from the disk tier without reading it whole: rows are read when asked for.

The same class serves a compressed chunk held in host memory (`tiers.chunks.stored_forms.BlobReader`):
its layers are decoded when asked for, a layer ahead of the compute like disk reads.

The header (tokens, frequency scores, geometry) is read when the chunk is pinned; K/V rows are
read per layer, only those the request reuses (the executor's layer loader asks for them a
layer ahead). Every row read is checked against its CRC; a failure raises `CorruptChunkError`
(the tier has dropped and counted the chunk; the batch falls back to a normal prefill).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from sglang_hicache_ext.fusion.chunk import ModelShape, check_geometry
from sglang_hicache_ext.tiers.chunks.disk_tier import ChunkReader
from sglang_hicache_ext.tiers.chunks.stored_forms import BlobReader


@dataclass
class StreamStats:
    """What one pinned chunk's reads cost (shared by its slices; written by the reader thread)."""

    bytes_read: int = 0
    read_s: float = 0.0  # time spent reading (and waiting for a throttled medium)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.read_s += seconds


class StreamedChunk:
    """Tokens [start, end) of a chunk file held open by `reader` (a `fusion.StoredChunk`)."""

    def __init__(
        self,
        reader: ChunkReader | BlobReader,
        start: int = 0,
        end: int | None = None,
        stats: StreamStats | None = None,
    ) -> None:
        self.reader = reader
        self.start = start
        self.end = reader.header.num_tokens if end is None else end
        self.stats = StreamStats() if stats is None else stats

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.reader.header.token_ids[self.start : self.end]

    @property
    def freq_scores(self) -> torch.Tensor:
        return self.reader.header.freq_scores[:, self.start : self.end]

    @property
    def alpha(self) -> float:
        return self.reader.header.alpha

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def num_layers(self) -> int:
        return self.reader.header.num_layers

    @property
    def in_memory(self) -> bool:
        return False

    @property
    def index_device(self) -> torch.device:
        return torch.device("cpu")  # rows are read from the file by host-side indices

    @property
    def from_disk(self) -> bool:
        """False for a compressed chunk decoded from host memory (no I/O)."""
        return isinstance(self.reader, ChunkReader)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole stored chunk (a compressed one's compressed size)."""
        return self.reader.header.stored_bytes

    @property
    def dense_bytes(self) -> int:
        """What reading these tokens at every layer would cost (the dense load)."""
        header = self.reader.header
        return self.num_tokens * (header.key_row_bytes + header.value_row_bytes) * self.num_layers

    def check_compatible(self, shape: ModelShape) -> None:
        header = self.reader.header
        check_geometry(header.num_layers, header.kv_heads, header.key_dim, shape)

    def rows(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        began = time.perf_counter()
        read = self.reader.read(layer, (rows.cpu() + self.start).tolist())
        self.stats.add(read.bytes_read, time.perf_counter() - began)
        return read.keys, read.values

    def slice(self, start: int, end: int) -> StreamedChunk:
        if (start, end) == (0, self.num_tokens):
            return self
        return StreamedChunk(self.reader, self.start + start, self.start + end, self.stats)
