"""A chunk in either of its stored forms, told apart by the first bytes: dense rows
(`dense_file.py`: sparse reads, each row checked) or compressed by a codec
(`compressed_file.py`: a layer read whole, checked, then decoded). The disk and shared
tiers store and read through these functions, so either form works on every tier.

A compressed chunk is held as its stored bytes (`StoredBlob`) in host memory too: the host
budget counts compressed bytes (more chunks fit), and a request decodes the layers it needs
(`BlobReader`), as it does from a disk file. Every tier therefore gives back the same rows.

Only codecs that decode to every token (int8, int4) are stored in tiers: a request reuses a
chunk's rows at any token, and SGLang's KV pool has no per-token mask to leave a dropped token
out of attention.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO, Generic, NamedTuple, TypeVar, cast

import torch

from sglang_hicache_ext.tiers.chunks.chunk_tensors import ChunkLike, ChunkTensors
from sglang_hicache_ext.tiers.chunks.codecs.base import KVCodec
from sglang_hicache_ext.tiers.chunks.codecs.dropping import TokenDroppingCodec
from sglang_hicache_ext.tiers.chunks.codecs.parse import QUANTIZED, parse_codec
from sglang_hicache_ext.tiers.chunks.compressed_file import (
    check_layer_blob,
    decode_layer,
    encode_compressed,
    is_compressed,
    parse_compressed_header,
)
from sglang_hicache_ext.tiers.chunks.dense_file import (
    check_storable,
    encode_chunk,
    parse_header,
    read_rows,
)
from sglang_hicache_ext.tiers.chunks.header import ChunkFileHeader, CorruptChunkError, RowSource


class LayerRows(NamedTuple):
    """Rows of one layer as a tier read them."""

    keys: torch.Tensor
    values: torch.Tensor
    bytes_read: int  # read from the medium (0 from memory)


class StoredBlob(NamedTuple):
    """A compressed chunk as stored, every layer verified: what host memory holds of it."""

    header: ChunkFileHeader
    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)


class BlobReader:
    """Layers of a `StoredBlob` decoded on demand (the `ChunkReader` interface, from memory)."""

    def __init__(self, blob: StoredBlob) -> None:
        self.key = blob.header.key
        self.header = blob.header
        self._data = memoryview(blob.data)

    def read(self, layer: int, rows: Sequence[int] | None) -> LayerRows:
        keys, values, _ = read_layer_rows(self._data, self.header, layer, rows)
        return LayerRows(keys, values, 0)

    def close(self) -> None:
        pass


def stored_codec(spec: str) -> KVCodec:
    """The codec of `spec` if tiers can store chunks with it; ValueError (the message a client
    or a settings file gets) otherwise."""
    if ":" not in spec and spec not in QUANTIZED:
        raise ValueError(f"unknown codec {spec!r}; stored chunks take int8 or int4")
    codec = parse_codec(spec)  # a bad drop ratio is told as such
    if isinstance(codec, TokenDroppingCodec):
        raise ValueError(
            f"codec {spec!r} drops tokens; stored chunks take int8 or int4 (a fused request may "
            "reuse any token, and the KV pool cannot leave a dropped one out of attention)"
        )
    return codec


def encode_stored(key: str, chunk: ChunkLike, codec: KVCodec | None) -> tuple[bytes, bytes]:
    """(header bytes, rest) of `chunk` stored under `key`, dense when `codec` is None."""
    check_storable(chunk)
    if codec is None:
        return encode_chunk(key, chunk)
    data = encode_compressed(key, chunk, codec)
    offset = parse_compressed_header(data, key).data_offset
    return data[:offset], data[offset:]


def blob_of(key: str, header: bytes, rows: bytes) -> StoredBlob:
    """A compressed chunk's encoded bytes as host memory holds them."""
    return StoredBlob(
        parse_stored_header(io.BytesIO(header), key, rows_follow=False), header + rows
    )


def compressed_blob(key: str, chunk: ChunkLike, codec: KVCodec) -> StoredBlob:
    """`chunk` compressed by `codec` as host memory holds it (its stored bytes)."""
    return blob_of(key, *encode_stored(key, chunk, codec))


def through_codec(chunk: ChunkLike, codec: KVCodec) -> ChunkTensors:
    """The rows a tier storing the chunk with `codec` gives back (what every request reads)."""
    keys, values = [], []
    for k, v in zip(chunk.keys, chunk.values, strict=True):
        decoded = codec.decode(codec.encode(k, v))
        if decoded.kept is not None:
            raise ValueError(f"codec {codec.spec} drops tokens; chunks in tiers keep every token")
        keys.append(decoded.keys)
        values.append(decoded.values)
    return ChunkTensors(
        tuple(chunk.token_ids), tuple(keys), tuple(values), chunk.freq_scores, chunk.alpha
    )


def kv_error(rows: ChunkLike, back: ChunkLike) -> float:
    """The largest relative error of `back`'s K or V against `rows`' over layers,
    |K' - K| / |K| (Frobenius norms)."""
    worst = 0.0
    pairs = zip((*rows.keys, *rows.values), (*back.keys, *back.values), strict=True)
    for exact, decoded in pairs:
        exact = exact.float()
        scale = float(torch.linalg.vector_norm(exact))
        if scale > 0:
            gap = float(torch.linalg.vector_norm(decoded.float() - exact))
            worst = max(worst, gap / scale)
    return worst


H = TypeVar("H")


class StoredChunkForms(Generic[H]):
    """What host memory holds of a chunk, for its retention (`retention.ChunkForms`): dense rows
    (a `ChunkLike`) or a compressed chunk's `StoredBlob`. `rebuild` turns a blob into the
    owner's host value; `below` says whether a lower tier keeps a key."""

    def __init__(self, rebuild: Callable[[StoredBlob], H], below: Callable[[str], bool]) -> None:
        self._rebuild = rebuild
        self.below = below

    def form(self, value: H) -> str:
        if isinstance(value, StoredBlob):
            return value.header.codec or "none"
        return "none"

    def tokens(self, value: H) -> int:
        if isinstance(value, StoredBlob):
            return value.header.num_tokens
        return len(cast(ChunkLike, value).token_ids)

    def nbytes(self, value: H) -> int:
        return int(cast(StoredBlob, value).nbytes)

    def compress(self, key: str, value: H, to: str) -> tuple[H, float]:
        rows = decode_chunk(value.data, key) if isinstance(value, StoredBlob) else value
        rows = cast(ChunkLike, rows)
        blob = compressed_blob(key, rows, stored_codec(to))
        return self._rebuild(blob), kv_error(rows, decode_chunk(blob.data, key))


def parse_stored_header(file: BinaryIO, name: str, rows_follow: bool = True) -> ChunkFileHeader:
    """The verified header of either form (see `dense_file.parse_header`)."""
    first = file.read(4)
    file.seek(0)
    if is_compressed(first):
        return parse_compressed_header(file, name, rows_follow).as_chunk_header()
    return parse_header(file, name, rows_follow)


def read_header(path: Path) -> ChunkFileHeader:
    with open(path, "rb") as file:
        return parse_stored_header(file, str(path))


def read_layer_rows(
    source: RowSource, header: ChunkFileHeader, layer: int, rows: Sequence[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """K and V of `rows` (sorted; None: all) of one layer, verified, and the bytes read. A
    compressed layer is read and decoded whole (it is smaller than the dense rows)."""
    compressed = header.compressed
    if compressed is None:
        return read_rows(source, header, layer, rows)
    decoded = decode_layer(source, compressed, layer)
    if decoded.kept is not None:
        raise CorruptChunkError(f"{header.key[:12]}: codec {compressed.codec} is not stored")
    nbytes = int(compressed.layers[layer]["length"])
    if rows is None:
        return decoded.keys, decoded.values, nbytes
    index = torch.tensor(list(rows), dtype=torch.long)
    return decoded.keys[index], decoded.values[index], nbytes


def decode_chunk(data: bytes, name: str, expected_key: str | None = None) -> ChunkTensors:
    """A whole chunk from its stored bytes, every row or layer verified."""
    header = parse_stored_header(io.BytesIO(data), name)
    _check_key(header, name, expected_key)
    return _all_rows(memoryview(data), header)


def load_stored(data: bytes, name: str, expected_key: str) -> ChunkTensors | StoredBlob:
    """What host memory holds of a chunk read whole from a tier: dense rows, or the compressed
    bytes with every layer verified; CorruptChunkError if anything fails its checks."""
    header = parse_stored_header(io.BytesIO(data), name)
    _check_key(header, name, expected_key)
    compressed = header.compressed
    if compressed is None:
        return _all_rows(memoryview(data), header)
    view = memoryview(data)
    for layer, entry in enumerate(compressed.layers):  # now: nothing corrupt is kept in memory
        begin = header.data_offset + int(entry["offset"])
        check_layer_blob(view[begin : begin + int(entry["length"])], compressed, layer)
    return StoredBlob(header, data)


def read_chunk(path: Path, expected_key: str | None = None) -> ChunkTensors:
    header = read_header(path)
    _check_key(header, str(path), expected_key)
    fd = os.open(path, os.O_RDONLY)
    try:
        return _all_rows(fd, header)
    finally:
        os.close(fd)


def _check_key(header: ChunkFileHeader, name: str, expected_key: str | None) -> None:
    if expected_key is not None and header.key != expected_key:
        raise CorruptChunkError(f"{name}: holds {header.key[:12]}, expected {expected_key[:12]}")


def _all_rows(source: RowSource, header: ChunkFileHeader) -> ChunkTensors:
    layers = [read_layer_rows(source, header, layer)[:2] for layer in range(header.num_layers)]
    return ChunkTensors(
        token_ids=header.token_ids,
        keys=tuple(k for k, _ in layers),
        values=tuple(v for _, v in layers),
        freq_scores=header.freq_scores.clone(),
        alpha=header.alpha,
    )
