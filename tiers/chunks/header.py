"""The header of a stored chunk, and the fixed part both stored forms begin with.

A chunk is stored as dense rows (`dense_file.py`) or compressed by a codec (`compressed_file.py`).
Both begin alike, told apart by the magic: a fixed part (magic, version, metadata length, CRC32
of the metadata), then the metadata as JSON, verified before it is parsed. Every tier indexes a
chunk by its `ChunkFileHeader` (tokens, geometry, scores, where its rows lie); a compressed
chunk's also carries its layer table (`CompressedHeader`).
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO, NamedTuple

import numpy as np
import torch

FIXED = struct.Struct("<4sHII")  # magic, version, metadata length, metadata CRC32

# Where rows are read from: an open file's descriptor, or the whole encoded chunk in memory
# (an object fetched from a remote store).
RowSource = int | bytes | memoryview


class CorruptChunkError(Exception):
    """A chunk file is truncated, fails a checksum, or is not a chunk file."""


def encode_metadata(magic: bytes, version: int, meta: dict[str, Any]) -> bytes:
    """The fixed part and the metadata block of a stored chunk."""
    meta_bytes = json.dumps(meta, separators=(",", ":")).encode()
    return FIXED.pack(magic, version, len(meta_bytes), zlib.crc32(meta_bytes)) + meta_bytes


def read_metadata(file: BinaryIO, name: str, magic: bytes, version: int, what: str) -> bytes:
    """The metadata block after the fixed part (magic, version, length, CRC32), verified."""
    fixed = file.read(FIXED.size)
    if len(fixed) != FIXED.size:
        raise CorruptChunkError(f"{name}: truncated header")
    found_magic, found_version, meta_len, meta_crc = FIXED.unpack(fixed)
    if found_magic != magic or found_version != version:
        raise CorruptChunkError(f"{name}: not {what} (bad magic or version)")
    meta_bytes = file.read(meta_len)
    if len(meta_bytes) != meta_len or zlib.crc32(meta_bytes) != meta_crc:
        raise CorruptChunkError(f"{name}: metadata checksum mismatch")
    return meta_bytes


@dataclass(frozen=True)
class ChunkFileHeader:
    """What a chunk file holds, and where each row lies (all verified when read)."""

    key: str
    token_ids: tuple[int, ...]
    num_layers: int
    kv_heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype
    alpha: float
    row_crcs: np.ndarray  # uint32 [2, layers, tokens]: K rows then V rows
    freq_scores: torch.Tensor  # float32 [layers, tokens]
    data_offset: int
    file_len: int
    # Set for a chunk stored compressed (`compressed_file.py`): its layer table. Its rows are
    # then read a whole layer at a time and decoded; `row_crcs` is empty.
    compressed: CompressedHeader | None = None

    @property
    def codec(self) -> str | None:
        """The codec of a compressed chunk; None for dense rows."""
        return None if self.compressed is None else self.compressed.codec

    @property
    def stored_bytes(self) -> int:
        if self.compressed is not None:
            return self.compressed.stored_bytes
        return self.data_offset + self.num_layers * self.layer_bytes

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def key_row_bytes(self) -> int:
        return self.kv_heads * self.key_dim * self.dtype.itemsize

    @property
    def value_row_bytes(self) -> int:
        return self.kv_heads * self.value_dim * self.dtype.itemsize

    @property
    def layer_bytes(self) -> int:
        return self.num_tokens * (self.key_row_bytes + self.value_row_bytes)

    def key_offset(self, layer: int) -> int:
        return self.data_offset + layer * self.layer_bytes

    def value_offset(self, layer: int) -> int:
        return self.key_offset(layer) + self.num_tokens * self.key_row_bytes


@dataclass(frozen=True)
class CompressedHeader:
    """What a compressed chunk holds: its codec, and per layer where its blob lies, its CRC32
    and the codec's tensors in it (`compressed_file.py`)."""

    key: str
    codec: str
    token_ids: tuple[int, ...]
    kv_heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype
    alpha: float
    freq_scores: torch.Tensor  # float32 [layers, tokens]
    layers: tuple[dict[str, Any], ...]  # offset, length, crc, tensors
    data_offset: int

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def stored_bytes(self) -> int:
        return self.data_offset + sum(int(layer["length"]) for layer in self.layers)

    def as_chunk_header(self) -> ChunkFileHeader:
        """The header every tier indexes chunks by (tokens, geometry, scores), pointing back
        here for the layer table."""
        return ChunkFileHeader(
            key=self.key,
            token_ids=self.token_ids,
            num_layers=self.num_layers,
            kv_heads=self.kv_heads,
            key_dim=self.key_dim,
            value_dim=self.value_dim,
            dtype=self.dtype,
            alpha=self.alpha,
            row_crcs=np.empty((2, self.num_layers, 0), dtype=np.uint32),  # layers carry CRCs
            freq_scores=self.freq_scores,
            data_offset=self.data_offset,
            file_len=self.stored_bytes,
            compressed=self,
        )


class ChunkSummary(NamedTuple):
    """What a listing shows of a chunk without loading its rows."""

    num_tokens: int
    num_layers: int
    nbytes: int  # bytes of its K, V and scores in memory
    codec: str | None = None  # how every tier stores it (None: dense rows)


def summary_of_header(header: ChunkFileHeader) -> ChunkSummary:
    scores = header.freq_scores.numel() * header.freq_scores.element_size()
    dense = header.num_layers * header.layer_bytes + scores
    in_memory = dense if header.compressed is None else header.stored_bytes
    return ChunkSummary(header.num_tokens, header.num_layers, in_memory, header.codec)
