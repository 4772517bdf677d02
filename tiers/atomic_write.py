"""Crash-safe file writes, as every stored file is written (pages, chunks, the TTL history).

A file becomes visible only by an atomic rename of a fully written and fsync'ed temp file in the
same directory (then the directory is fsync'ed), so a crash leaves either the old file, the new
file, or a stray `.<name>.<uuid>.tmp` that the directory's owner removes when it opens it.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

TEMP_SUFFIX = ".tmp"


def write_temp(path: Path, header: bytes, payload: bytes, mtime: float) -> Path:
    """Fully write and fsync a temp file beside `path`; `commit` makes it visible.

    `mtime` is the file's last-access time (the owner's clock), kept in the file's mtime.
    """
    temp = path.with_name(f".{path.name}.{uuid.uuid4().hex}{TEMP_SUFFIX}")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, header)
            _write_all(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.utime(temp, (mtime, mtime))
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return temp


def commit(temp: Path, path: Path) -> None:
    """Atomically replace `path` by `temp` (readers see the old or the new file, never a mix)."""
    try:
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
