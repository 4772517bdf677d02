"""Exclusive ownership of a directory by one live process: `flock` on a lock file inside it.

Why `flock` (BSD locks) and not `fcntl`/`lockf` (POSIX record locks): a flock belongs to the open
file description, so a second `DirectoryLock` on the same directory conflicts even inside the
same process (two stores in one process must not share a root either), and the kernel drops it
when its holder dies, whatever the way (SIGKILL included): no stale lock to clean up.

Process creation, checked by `tests/test_dir_lock.py`:
- spawn / exec (SGLang starts its schedulers with `spawn`): the descriptor is close-on-exec, so
  the child does not hold the lock;
- fork: a forked child would inherit the descriptor and keep the lock alive after its owner
  released it (or died); an at-fork hook closes inherited lock descriptors in the child (close
  only: unlocking there would unlock the parent too), so a lock lives exactly as long as its
  owner holds it.

The lock file is never deleted: a deleted-and-recreated lock file would let two processes
each hold "the" lock. It holds the holder's PID (informational, for the error message).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import weakref
from pathlib import Path

LOCK_FILE_NAME = ".lock"


class DirectoryLockedError(RuntimeError):
    """Another live process (or another object in this one) holds the directory."""

    def __init__(self, directory: Path, holder_pid: int | None) -> None:
        holder = f"process {holder_pid}" if holder_pid is not None else "another process"
        if holder_pid == os.getpid():
            holder = f"this process ({holder_pid}), through another open handle"
        super().__init__(f"{directory} is in use by {holder}")
        self.directory = directory
        self.holder_pid = holder_pid


class DirectoryLock:
    """Holds an exclusive flock on `directory/name` from construction until `release()`.

    Construction fails at once (no waiting) with `DirectoryLockedError` when it is held
    elsewhere; other OS errors (no such directory, a file system without flock) propagate.
    """

    def __init__(self, directory: str | Path, name: str = LOCK_FILE_NAME) -> None:
        self.directory = Path(directory)
        self.path = self.directory / name
        self._mutex = threading.Lock()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            holder = _read_pid(fd)
            os.close(fd)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise DirectoryLockedError(self.directory, holder) from None
            raise
        self._fd: int | None = fd
        with contextlib.suppress(OSError):  # the PID is only for messages
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _held.add(self)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Give the directory up (idempotent). Closing the descriptor drops the flock."""
        with self._mutex:
            fd, self._fd = self._fd, None
        if fd is not None:
            _held.discard(self)
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> DirectoryLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        # An owner dropped without close() (e.g. `del store`) must not keep its directory.
        with contextlib.suppress(Exception):
            self.release()

    def _forget_after_fork(self) -> None:
        """In a forked child: close the inherited descriptor without unlocking."""
        fd, self._fd = self._fd, None
        self._mutex = threading.Lock()  # the parent's may have been held at fork time
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def holder_pid(directory: str | Path, name: str = LOCK_FILE_NAME) -> int | None:
    """The PID recorded by the last holder of `directory`'s lock (it may have exited)."""
    try:
        fd = os.open(Path(directory) / name, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return _read_pid(fd)
    finally:
        os.close(fd)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


_held: weakref.WeakSet[DirectoryLock] = weakref.WeakSet()


def _close_inherited_locks() -> None:
    for lock in list(_held):
        lock._forget_after_fork()
    _held.clear()


os.register_at_fork(after_in_child=_close_inherited_locks)
