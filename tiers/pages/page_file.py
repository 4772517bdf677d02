"""On-disk format of one page.

Layout: fixed header | key (utf-8) | group (utf-8) | header CRC32 | payload. The header CRC covers
everything before it; the payload CRC32 is stored in the header and checked on every read. Pages
are written through `tiers/atomic_write.py` (temp file, fsync, atomic rename, directory fsync),
so a crash leaves either the old file, the new file, or a stray temp file.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import BinaryIO, NamedTuple

MAGIC = b"HKVP"
VERSION = 1
PAGE_SUFFIX = ".page"
_FIXED = struct.Struct("<4sHHHQddI")  # magic, version, key len, group len, payload len,
# write time, expiry at write, payload crc
_CRC = struct.Struct("<I")


class CorruptPageError(Exception):
    """A page file is truncated, has a bad checksum, or belongs to another key."""


class PageHeader(NamedTuple):
    """What a page file's header says (checked by its header CRC when read)."""

    key: str
    group: str  # the page's group when it was written
    payload_len: int
    write_time: float
    expiry: float  # as computed at write time; an opening store recomputes it
    payload_crc: int  # CRC32 of the payload, checked on every read
    header_len: int  # bytes before the payload: fixed part, key, group, header CRC

    @property
    def file_len(self) -> int:
        return self.header_len + self.payload_len


def encode_header(key: str, group: str, payload: bytes, write_time: float, expiry: float) -> bytes:
    key_bytes, group_bytes = key.encode(), group.encode()
    prefix = (
        _FIXED.pack(
            MAGIC,
            VERSION,
            len(key_bytes),
            len(group_bytes),
            len(payload),
            write_time,
            expiry,
            zlib.crc32(payload),
        )
        + key_bytes
        + group_bytes
    )
    return prefix + _CRC.pack(zlib.crc32(prefix))


def read_header(path: Path) -> PageHeader:
    """Parse and verify the header; also checks the file is exactly as long as announced."""
    with open(path, "rb") as file:
        header = _parse_header(file)
        file.seek(0, os.SEEK_END)
        if file.tell() != header.file_len:
            raise CorruptPageError(f"{path}: {file.tell()} bytes, header says {header.file_len}")
    return header


def read_page(path: Path, expected_key: str) -> tuple[PageHeader, bytes]:
    """Header and payload, both verified (CRC, length, key)."""
    with open(path, "rb") as file:
        header = _parse_header(file)
        payload = file.read(header.payload_len + 1)
    if header.key != expected_key:
        raise CorruptPageError(f"{path}: holds key {header.key!r}, expected {expected_key!r}")
    if len(payload) != header.payload_len:
        raise CorruptPageError(f"{path}: payload length {len(payload)} != {header.payload_len}")
    if zlib.crc32(payload) != header.payload_crc:
        raise CorruptPageError(f"{path}: payload checksum mismatch")
    return header, payload


def _parse_header(file: BinaryIO) -> PageHeader:
    fixed = file.read(_FIXED.size)
    if len(fixed) != _FIXED.size:
        raise CorruptPageError("truncated header")
    magic, version, key_len, group_len, payload_len, write_time, expiry, payload_crc = (
        _FIXED.unpack(fixed)
    )
    if magic != MAGIC or version != VERSION:
        raise CorruptPageError("not a page file (bad magic or version)")
    names = file.read(key_len + group_len)
    crc = file.read(_CRC.size)
    if len(names) != key_len + group_len or len(crc) != _CRC.size:
        raise CorruptPageError("truncated header")
    if _CRC.unpack(crc)[0] != zlib.crc32(fixed + names):
        raise CorruptPageError("header checksum mismatch")
    try:
        key, group = names[:key_len].decode(), names[key_len:].decode()
    except UnicodeDecodeError as error:
        raise CorruptPageError("undecodable key or group") from error
    return PageHeader(
        key, group, payload_len, write_time, expiry, payload_crc, _FIXED.size + len(names) + 4
    )
