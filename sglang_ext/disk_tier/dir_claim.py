"""A server's claim on its `disk_dir`: one server per disk folder, held for the process's life."""

from __future__ import annotations

import threading
from pathlib import Path

from sglang_hicache_ext.tiers.dir_lock import DirectoryLock

SERVER_LOCK_NAME = "server.lock"  # in disk_dir: one server per disk_dir

_server_locks: dict[Path, DirectoryLock] = {}
_server_locks_mutex = threading.Lock()


def hold_disk_dir(disk_dir: str | Path) -> Path:
    """Claim `disk_dir` for the server this process launches, until the process exits.

    Called by the preflight check in the launching process, before SGLang starts its
    schedulers: a second server on the same folder must fail there, in one line, not in a
    scheduler's traceback. Re-entrant within a process (an `Engine` started again).
    Raises `sglang_hicache_ext.tiers.dir_lock.DirectoryLockedError` (holder's PID) or OSError.
    """
    path = Path(disk_dir).expanduser().absolute()
    with _server_locks_mutex:
        held = _server_locks.get(path)
        if held is not None and held.held:
            return path
        path.mkdir(parents=True, exist_ok=True)
        _server_locks[path] = DirectoryLock(path, SERVER_LOCK_NAME)
    return path


def release_disk_dir(disk_dir: str | Path) -> None:
    """Give up a claim of `hold_disk_dir` (tests, or an embedding application shutting down)."""
    with _server_locks_mutex:
        lock = _server_locks.pop(Path(disk_dir).expanduser().absolute(), None)
    if lock is not None:
        lock.release()
