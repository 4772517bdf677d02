"""The page files of a page store's `pages/` folder: where a key's file lives, listing,
deleting, and the checks that decide which files an opening store may index.

OS errors are logged and counted in the store's counters (`io_errors`, `corrupt_pages`,
`removed_temp_files`), never raised. Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from sglang_hicache_ext.tiers.atomic_write import TEMP_SUFFIX
from sglang_hicache_ext.tiers.pages.page_file import (
    PAGE_SUFFIX,
    CorruptPageError,
    PageHeader,
    read_header,
)

logger = logging.getLogger(__name__)


class FoundPage(NamedTuple):
    """A page file that passed the header and name checks on open."""

    path: Path
    header: PageHeader
    last_access: float  # the later of write time and mtime (every read refreshes the mtime)


def check_key(key: str) -> None:
    if not isinstance(key, str) or not key:
        raise ValueError(f"page key must be a non-empty string, got {key!r}")


class PageDirectory:
    """`pages/<2 hex>/<sha256 of the key>.page` below a store's root."""

    def __init__(self, path: Path, counts: dict[str, int]) -> None:
        self.path = path
        self._counts = counts  # the store's counters, shared

    def path_of(self, key: str) -> Path:
        digest = hashlib.sha256(key.encode()).hexdigest()
        return self.path / digest[:2] / (digest + PAGE_SUFFIX)

    def unlink(self, path: Path) -> None:
        """Delete a file; an OS error is logged and counted (the file stays, unindexed)."""
        try:
            path.unlink(missing_ok=True)
        except OSError as error:
            self._counts["io_errors"] += 1
            logger.error("disk store: could not delete %s: %s", path, error)

    def files(self) -> list[Path]:
        """Every file below the folder, sorted; folders that vanish or cannot be listed are
        logged and counted, not raised (rglob would raise for a folder removed mid-walk)."""

        def unlisted(error: OSError) -> None:
            self._counts["io_errors"] += 1
            logger.error("disk store: cannot list %s: %s", error.filename, error)

        return sorted(
            Path(folder) / name
            for folder, _, names in os.walk(self.path, onerror=unlisted)
            for name in names
        )

    def usage_bytes(self) -> int:
        """Bytes of all files below the folder, temp files included."""
        total = 0
        for path in self.files():
            # A failed write removes its temp file without the lock: tolerate that race.
            with contextlib.suppress(FileNotFoundError):
                total += path.stat().st_size
        return total

    def found_pages(self) -> Iterator[FoundPage]:
        """The page files to index on open (the caller holds the folder's lock, so every temp
        file is stray): temp files and files failing the checks are removed and counted;
        per-file OS errors are counted and the file skipped."""
        for path in self.files():
            if path.name.endswith(TEMP_SUFFIX):
                self._counts["removed_temp_files"] += 1
                logger.warning("disk store: removing partial write %s", path)
                self.unlink(path)
                continue
            header = self._checked_header(path)
            if header is None:
                continue
            try:
                mtime = path.stat().st_mtime
            except OSError as error:
                self._counts["io_errors"] += 1
                logger.error("disk store: skipping %s: %s", path, error)
                continue
            yield FoundPage(path, header, max(header.write_time, mtime))

    def _checked_header(self, path: Path) -> PageHeader | None:
        try:
            header = read_header(path)
            if self.path_of(header.key) != path:
                raise CorruptPageError(f"{path}: file name does not match key {header.key!r}")
        except (CorruptPageError, OSError) as error:
            self._counts["io_errors" if isinstance(error, OSError) else "corrupt_pages"] += 1
            logger.error("disk store: removing unreadable page file %s: %s", path, error)
            self.unlink(path)
            return None
        return header
