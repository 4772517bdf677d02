"""Stored form of a chunk as dense rows, laid out so that a reader can fetch only some rows.

Layout: fixed part | metadata (JSON) | row checksums | frequency scores | K/V rows.

- fixed part: magic, version, metadata length, CRC32 of the metadata (`header.py`);
- metadata: key, token ids, geometry, dtype, alpha, and the CRC32 of the checksum table and of
  the scores (so a verified metadata block vouches for both);
- row checksums: CRC32 of every token row of every layer, K and V apart ([2, layers, tokens]);
- K/V rows: per layer, K as [tokens, kv_heads, key_dim] then V as [tokens, kv_heads, value_dim],
  row-major, so the rows of one token in one layer are one contiguous run.

Per-row checksums are what make sparse reads safe: a reader that loads 85 % of the rows verifies
exactly those, instead of reading a whole layer to check one checksum. Files are written through
`tiers/atomic_write.py` (temp file, fsync, atomic rename, directory fsync).
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Sequence
from typing import BinaryIO

import numpy as np
import torch

from sglang_hicache_ext.tiers.chunks.chunk_tensors import ChunkLike, tensor_bytes
from sglang_hicache_ext.tiers.chunks.header import (
    ChunkFileHeader,
    CorruptChunkError,
    RowSource,
    encode_metadata,
    read_metadata,
)

MAGIC = b"HKVC"
VERSION = 1
_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
}


def check_storable(chunk: ChunkLike) -> None:
    """ValueError unless the chunk's rows have a dtype its file can hold."""
    dtype = chunk.keys[0].dtype
    if str(dtype).removeprefix("torch.") not in _DTYPES:
        raise ValueError(f"chunk dtype {dtype} cannot be stored (float32, float16, bfloat16)")


def encode_chunk(key: str, chunk: ChunkLike) -> tuple[bytes, bytes]:
    """(header bytes, row bytes) of the file for `chunk` stored under `key`."""
    check_storable(chunk)
    dtype = chunk.keys[0].dtype
    n, heads, key_dim = chunk.keys[0].shape
    value_dim = chunk.values[0].shape[2]
    num_layers = len(chunk.keys)
    layers: list[bytes] = []
    crcs = np.empty((2, num_layers, n), dtype=np.uint32)
    for layer, tensors in enumerate(zip(chunk.keys, chunk.values, strict=True)):
        for side, tensor in enumerate(tensors):
            data = tensor_bytes(tensor.to(dtype))
            row, view = len(data) // n, memoryview(data)  # slices of a view copy nothing
            crcs[side, layer] = [zlib.crc32(view[i * row : (i + 1) * row]) for i in range(n)]
            layers.append(data)
    table = crcs.tobytes()
    scores = tensor_bytes(chunk.freq_scores.to(torch.float32))
    meta = {
        "key": key,
        "token_ids": list(chunk.token_ids),
        "num_layers": num_layers,
        "kv_heads": int(heads),
        "key_dim": int(key_dim),
        "value_dim": int(value_dim),
        "dtype": str(dtype).removeprefix("torch."),
        "alpha": chunk.alpha,
        "table_crc": zlib.crc32(table),
        "scores_crc": zlib.crc32(scores),
    }
    return encode_metadata(MAGIC, VERSION, meta) + table + scores, b"".join(layers)


def parse_header(file: BinaryIO, name: str, rows_follow: bool = True) -> ChunkFileHeader:
    """Parse and verify the header of a chunk file (or of its bytes). With `rows_follow` the
    rows must follow it to the exact length; without, `file` holds the header alone (a remote
    store keeps a copy of it apart, to index a chunk without fetching its rows)."""
    meta_bytes = read_metadata(file, name, MAGIC, VERSION, "a chunk file")
    try:
        meta = json.loads(meta_bytes)
        dtype = _DTYPES[meta["dtype"]]
        layers, n = int(meta["num_layers"]), len(meta["token_ids"])
    except (ValueError, KeyError, TypeError) as error:
        raise CorruptChunkError(f"{name}: unreadable metadata") from error
    table = file.read(2 * layers * n * 4)
    scores = file.read(layers * n * 4)
    if zlib.crc32(table) != meta["table_crc"] or zlib.crc32(scores) != meta["scores_crc"]:
        raise CorruptChunkError(f"{name}: checksum table or scores mismatch")
    data_offset = file.tell()
    file.seek(0, os.SEEK_END)
    file_len = file.tell()
    header = ChunkFileHeader(
        key=meta["key"],
        token_ids=tuple(int(t) for t in meta["token_ids"]),
        num_layers=layers,
        kv_heads=int(meta["kv_heads"]),
        key_dim=int(meta["key_dim"]),
        value_dim=int(meta["value_dim"]),
        dtype=dtype,
        alpha=float(meta["alpha"]),
        row_crcs=np.frombuffer(table, dtype=np.uint32).reshape(2, layers, n),
        freq_scores=torch.frombuffer(bytearray(scores), dtype=torch.float32).reshape(layers, n),
        data_offset=data_offset,
        file_len=file_len,
    )
    expected = data_offset + layers * header.layer_bytes
    if rows_follow and file_len != expected:
        raise CorruptChunkError(f"{name}: {file_len} bytes, header says {expected}")
    return header


def read_rows(
    source: RowSource, header: ChunkFileHeader, layer: int, rows: Sequence[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """K and V of `rows` (sorted token indices; None: all) of one layer, each row verified.

    Returns (K [len(rows), heads, key_dim], V [len(rows), heads, value_dim], bytes read).
    Consecutive rows are read with one `pread` per run.
    """
    n = header.num_tokens
    wanted = list(range(n)) if rows is None else list(rows)
    if any(b <= a for a, b in zip(wanted, wanted[1:], strict=False)) or (
        wanted and not 0 <= wanted[0] <= wanted[-1] < n
    ):
        raise ValueError(f"rows must be sorted, distinct and within [0, {n})")
    keys = _read_side(source, header, layer, wanted, 0)
    values = _read_side(source, header, layer, wanted, 1)
    shape_k = (len(wanted), header.kv_heads, header.key_dim)
    shape_v = (len(wanted), header.kv_heads, header.value_dim)
    return (
        _tensor_of(keys, header.dtype, shape_k),
        _tensor_of(values, header.dtype, shape_v),
        len(keys) + len(values),
    )


def _read_side(
    source: RowSource, header: ChunkFileHeader, layer: int, rows: list[int], side: int
) -> bytearray:
    row_bytes = header.key_row_bytes if side == 0 else header.value_row_bytes
    base = header.key_offset(layer) if side == 0 else header.value_offset(layer)
    crcs = header.row_crcs[side, layer]
    out = bytearray()
    for first, count in _runs(rows):
        offset = base + first * row_bytes
        if isinstance(source, int):
            data = os.pread(source, count * row_bytes, offset)
        else:
            data = bytes(source[offset : offset + count * row_bytes])
        if len(data) != count * row_bytes:
            raise CorruptChunkError(f"layer {layer}: short read")
        for i in range(count):
            if zlib.crc32(data[i * row_bytes : (i + 1) * row_bytes]) != crcs[first + i]:
                side_name = "K" if side == 0 else "V"
                raise CorruptChunkError(f"layer {layer} {side_name} row {first + i}: bad checksum")
        out += data
    return out


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """Sorted rows as (first, count) runs of consecutive indices."""
    runs: list[tuple[int, int]] = []
    for row in rows:
        if runs and runs[-1][0] + runs[-1][1] == row:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((row, 1))
    return runs


def _tensor_of(data: bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(shape)
