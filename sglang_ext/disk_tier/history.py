"""The TTL access history of one shard folder: reloaded at start, saved when it changed.

SGLang stops schedulers by signal, without `close()`, so the backend saves every
`ttl_history_save_s` as well as on close; saves are atomic renames (`history_file`).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from sglang_hicache_ext.tuning.ttl.history_file import (
    HistoryFileError,
    load_history,
    save_history,
    stray_temp_files,
)
from sglang_hicache_ext.tuning.ttl.online import OnlineTtl, RestoredHistory

logger = logging.getLogger(__name__)

HISTORY_FILE_NAME = "ttl-history.bin"  # in the shard folder, beside the store's `pages/`


class TtlHistoryFile:
    """Restores `online`'s history from `path` and saves it there; never raises (errors are
    logged and counted in `load_errors` / `save_errors`)."""

    def __init__(self, path: Path, online: OnlineTtl, backend_name: str) -> None:
        self.path = path
        self._online = online
        self._backend_name = backend_name
        self._lock = threading.Lock()  # the counts and the last save's summary
        self._save_mutex = threading.Lock()  # the maintenance thread and close() both save
        self.load_errors = 0
        self.save_errors = 0
        self.load_error: str | None = None
        self.restored = RestoredHistory(0, 0, False)
        self._saved_changes = online.changes
        self._last_save_try = time.monotonic()
        self._saved: dict[str, Any] = {
            "requests": 0,
            "page_accesses": 0,
            "bytes": None,
            "at_s": None,
        }

    def restore(self) -> RestoredHistory:
        """The TTL history of the last run, if its file is usable; else start from empty.

        Call before the store opens (its index computes expiries from the restored TTLs).
        Reading without the folder's lock is safe: saves are atomic renames; nothing is written.
        """
        try:
            history = load_history(self.path)
            if history is not None:
                self.restored = self._online.restore(history)
        except (OSError, HistoryFileError, ValueError) as error:
            with self._lock:
                self.load_errors += 1
            self.load_error = f"{type(error).__name__}: {error}"
            logger.error(
                "%s: TTL history %s ignored (starting from empty): %s",
                self._backend_name,
                self.path,
                error,
            )
        self._saved_changes = self._online.changes  # what is on disk already (restored)
        self._saved["requests"] = self.restored.requests
        self._saved["page_accesses"] = self.restored.page_accesses
        return self.restored

    def remove_stray_temps(self) -> None:
        """Interrupted saves of the last run (only once we own the folder)."""
        for temp in stray_temp_files(self.path):
            try:
                temp.unlink(missing_ok=True)
            except OSError as error:
                with self._lock:
                    self.save_errors += 1
                logger.error("%s: cannot remove %s: %s", self._backend_name, temp, error)

    def save_due(self, interval_s: float) -> bool:
        return time.monotonic() - self._last_save_try >= interval_s

    def save(self) -> bool:
        """Save the TTL history if it changed since the last save; False when that failed."""
        with self._save_mutex:
            self._last_save_try = time.monotonic()
            changes = self._online.changes
            if changes == self._saved_changes:
                return True
            try:
                history = self._online.history()
                size = save_history(self.path, history)
            except Exception as error:  # disk full, folder gone, ...: retried next interval
                with self._lock:
                    self.save_errors += 1
                logger.error("%s: saving the TTL history failed: %s", self._backend_name, error)
                return False
            self._saved_changes = changes
            with self._lock:
                self._saved = {
                    "requests": len(history.requests),
                    "page_accesses": history.page_accesses,
                    "bytes": size,
                    "at_s": history.saved_at_s,
                }
            return True

    def status(self, save_interval_s: float) -> dict[str, Any]:
        """The `ttl_history` part of the backend's status."""
        with self._lock:
            saved = dict(self._saved)
        return {
            "file": str(self.path),
            "save_interval_s": save_interval_s,
            "reloaded_requests": self.restored.requests,
            "reloaded_page_accesses": self.restored.page_accesses,
            "reloaded_plan": self.restored.plan_restored,
            "load_error": self.load_error,
            "saved_requests": saved["requests"],
            "saved_page_accesses": saved["page_accesses"],
            "saved_bytes": saved["bytes"],
            "saved_at_s": saved["at_s"],
        }

    def error_counts(self) -> dict[str, int]:
        with self._lock:
            return {
                "history_load_errors": self.load_errors,
                "history_save_errors": self.save_errors,
            }
