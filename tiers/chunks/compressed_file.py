"""Stored form of a chunk compressed by a codec: one blob, each layer decodable on its own.

Layout: fixed part | metadata (JSON) | frequency scores | layer blobs.

- fixed part: magic, version, metadata length, CRC32 of the metadata (`header.py`);
- metadata: key, codec spec, token ids, geometry, dtype, alpha, the CRC32 of the scores, and per
  layer its offset, length, CRC32 and tensors (name, dtype, shape, offset within the layer);
- layer blobs: the codec's tensors of each layer, back to back.

A layer is verified (CRC32 of its whole blob) before it is decoded: a compressed chunk that fails
is never decompressed into attention; the caller drops it and computes the tokens instead.
"""

from __future__ import annotations

import io
import json
import math
import os
import zlib
from collections.abc import Callable
from typing import Any, BinaryIO

import torch

from sglang_hicache_ext.tiers.chunks.chunk_tensors import ChunkLike, tensor_bytes
from sglang_hicache_ext.tiers.chunks.codecs.base import CompressedLayer, DecodedLayer, KVCodec
from sglang_hicache_ext.tiers.chunks.codecs.parse import parse_codec
from sglang_hicache_ext.tiers.chunks.header import (
    FIXED,
    CompressedHeader,
    CorruptChunkError,
    RowSource,
    encode_metadata,
    read_metadata,
)

MAGIC = b"HKVZ"
VERSION = 1
_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.int32)
}


def encode_compressed(
    key: str,
    chunk: ChunkLike,
    codec: KVCodec,
    queries: Callable[[int], torch.Tensor | None] = lambda layer: None,
) -> bytes:
    """The stored form of `chunk` under `key`; `queries(layer)` gives a scorer's probe queries."""
    blobs: list[bytes] = []
    layers: list[dict[str, Any]] = []
    offset = 0
    for index, (keys, values) in enumerate(zip(chunk.keys, chunk.values, strict=True)):
        layer = codec.encode(keys, values, queries(index))
        parts, tensors, inner = [], [], 0
        for name, tensor in layer.tensors.items():
            data = tensor_bytes(tensor)
            dtype = str(tensor.dtype).removeprefix("torch.")
            tensors.append({"name": name, "dtype": dtype, "shape": list(tensor.shape), "at": inner})
            parts.append(data)
            inner += len(data)
        blob = b"".join(parts)
        layers.append(
            {"offset": offset, "length": len(blob), "crc": zlib.crc32(blob), "tensors": tensors}
        )
        blobs.append(blob)
        offset += len(blob)
    scores = tensor_bytes(chunk.freq_scores.to(torch.float32))
    _, heads, key_dim = chunk.keys[0].shape
    meta = {
        "key": key,
        "codec": codec.spec,
        "token_ids": list(chunk.token_ids),
        "kv_heads": int(heads),
        "key_dim": int(key_dim),
        "value_dim": int(chunk.values[0].shape[2]),
        "dtype": str(chunk.keys[0].dtype).removeprefix("torch."),
        "alpha": chunk.alpha,
        "scores_crc": zlib.crc32(scores),
        "layers": layers,
    }
    return encode_metadata(MAGIC, VERSION, meta) + scores + b"".join(blobs)


def is_compressed(first_bytes: bytes) -> bool:
    return first_bytes[: len(MAGIC)] == MAGIC


def parse_compressed_header(
    data: bytes | memoryview | BinaryIO, name: str, rows_follow: bool = True
) -> CompressedHeader:
    """The verified header of a stored compressed chunk (its layers are checked when read).
    With `rows_follow` the layer blobs must follow to the exact length; without, `data` is the
    header alone (a remote store keeps it apart, to index a chunk without fetching it)."""
    file = io.BytesIO(bytes(data)) if isinstance(data, bytes | memoryview) else data
    meta_bytes = read_metadata(file, name, MAGIC, VERSION, "a compressed chunk")
    try:
        meta = json.loads(meta_bytes)
        n, layers = len(meta["token_ids"]), meta["layers"]
        dtype = _DTYPES[meta["dtype"]]
        geometry = int(meta["kv_heads"]), int(meta["key_dim"]), int(meta["value_dim"])
    except (ValueError, KeyError, TypeError) as error:
        raise CorruptChunkError(f"{name}: unreadable metadata") from error
    scores = file.read(4 * n * len(layers))
    if zlib.crc32(scores) != meta["scores_crc"]:
        raise CorruptChunkError(f"{name}: scores checksum mismatch")
    header = CompressedHeader(
        key=meta["key"],
        codec=meta["codec"],
        token_ids=tuple(int(t) for t in meta["token_ids"]),
        kv_heads=geometry[0],
        key_dim=geometry[1],
        value_dim=geometry[2],
        dtype=dtype,
        alpha=float(meta["alpha"]),
        freq_scores=torch.frombuffer(bytearray(scores), dtype=torch.float32).reshape(
            len(layers), n
        ),
        layers=tuple(layers),
        data_offset=FIXED.size + len(meta_bytes) + len(scores),
    )
    file.seek(0, os.SEEK_END)
    if rows_follow and file.tell() != header.stored_bytes:
        raise CorruptChunkError(f"{name}: {file.tell()} bytes, header says {header.stored_bytes}")
    return header


def decode_layer(source: RowSource, header: CompressedHeader, layer: int) -> DecodedLayer:
    """Layer `layer` read (from an open file's descriptor or the whole stored bytes), verified
    and decompressed; CorruptChunkError if its blob fails its CRC."""
    return decode_layer_blob(read_layer_blob(source, header, layer), header, layer)


def read_layer_blob(source: RowSource, header: CompressedHeader, layer: int) -> bytes:
    entry = header.layers[layer]
    begin, length = header.data_offset + int(entry["offset"]), int(entry["length"])
    if isinstance(source, int):
        blob = os.pread(source, length, begin)
    else:
        blob = bytes(source[begin : begin + length])
    if len(blob) != length:
        raise CorruptChunkError(f"{header.key[:12]} layer {layer}: short read")
    return blob


def check_layer_blob(blob: bytes | memoryview, header: CompressedHeader, layer: int) -> None:
    """CorruptChunkError unless `blob` is layer `layer` as written (its CRC32)."""
    if zlib.crc32(blob) != header.layers[layer]["crc"]:
        raise CorruptChunkError(f"{header.key[:12]} layer {layer}: checksum mismatch")


def decode_layer_blob(blob: bytes, header: CompressedHeader, layer: int) -> DecodedLayer:
    check_layer_blob(blob, header, layer)
    entry = header.layers[layer]
    tensors = {}
    for spec in entry["tensors"]:
        dtype = _DTYPES[spec["dtype"]]
        size = dtype.itemsize * math.prod(spec["shape"])
        raw = bytearray(blob[spec["at"] : spec["at"] + size])
        tensors[spec["name"]] = (
            torch.frombuffer(raw, dtype=dtype).reshape(spec["shape"])
            if raw
            else torch.empty(spec["shape"], dtype=dtype)
        )
    compressed = CompressedLayer(header.codec, len(header.token_ids), header.dtype, tensors)
    return parse_codec(header.codec).decode(compressed)
