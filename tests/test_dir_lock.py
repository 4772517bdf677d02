"""Directory ownership: one holder at a time, across processes (fork, spawn, exec), freed when
the holder releases it or dies; and the launch-time claim of `disk_dir` by the preflight check."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sglang_hicache_ext.sglang_ext.config.disk_tier_settings import disk_tier_extra_config
from sglang_hicache_ext.tiers.dir_lock import DirectoryLock, DirectoryLockedError, holder_pid

REPO = Path(__file__).resolve().parent.parent
NAME = "test.lock"


def test_second_handle_fails_at_once_naming_directory_and_holder(tmp_path: Path) -> None:
    first = DirectoryLock(tmp_path, NAME)
    with pytest.raises(DirectoryLockedError) as caught:
        DirectoryLock(tmp_path, NAME)  # same process, another handle: still refused
    assert caught.value.directory == tmp_path and caught.value.holder_pid == os.getpid()
    assert str(tmp_path) in str(caught.value) and str(os.getpid()) in str(caught.value)
    assert holder_pid(tmp_path, NAME) == os.getpid()
    first.release()
    first.release()  # idempotent
    with DirectoryLock(tmp_path, NAME) as second:
        assert second.held
    assert not second.held


def test_dropping_the_owner_frees_the_directory(tmp_path: Path) -> None:
    lock = DirectoryLock(tmp_path, NAME)
    del lock  # e.g. a store dropped without close()
    DirectoryLock(tmp_path, NAME).release()


def _try_then_wait(directory: str, report: Any, done: Any) -> None:
    """Child: report whether the directory can be claimed, then stay alive until told."""
    try:
        DirectoryLock(directory, NAME).release()
        report.put(("acquired", None))
    except DirectoryLockedError as error:
        report.put(("locked", error.holder_pid))
    done.wait(60)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_children_neither_get_nor_keep_the_lock(tmp_path: Path, start_method: str) -> None:
    """SGLang starts schedulers with spawn; fork is checked too. A child sees the directory as
    held by its parent, and once the parent releases it, a still-running child does not keep it
    held (a forked child inherited the descriptor: the at-fork hook closed it there)."""
    context = multiprocessing.get_context(start_method)
    lock = DirectoryLock(tmp_path, NAME)
    report, done = context.Queue(), context.Event()
    child = context.Process(target=_try_then_wait, args=(str(tmp_path), report, done))
    child.start()
    try:
        assert report.get(timeout=120) == ("locked", os.getpid())
        lock.release()
        assert child.is_alive()
        DirectoryLock(tmp_path, NAME).release()  # free although the child still runs
    finally:
        done.set()
        child.join(60)
    assert child.exitcode == 0


HOLDER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {repo!r})
    from sglang_hicache_ext.tiers.dir_lock import DirectoryLock
    lock = DirectoryLock({directory!r}, {name!r})
    print("held", flush=True)
    sys.stdin.read()
    """
)


def _holder(directory: Path, name: str = NAME) -> subprocess.Popen[str]:
    script = HOLDER.format(repo=str(REPO), directory=str(directory), name=name)
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "held"
    return child


def test_a_killed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    child = _holder(tmp_path)
    try:
        with pytest.raises(DirectoryLockedError) as caught:
            DirectoryLock(tmp_path, NAME)
        assert caught.value.holder_pid == child.pid
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
    DirectoryLock(tmp_path, NAME).release()  # the kernel dropped the dead holder's flock


def _disk_tier_args(disk_dir: Path) -> SimpleNamespace:
    extra = {
        **disk_tier_extra_config(str(disk_dir)),
    }
    return SimpleNamespace(
        hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=json.dumps(extra),
        radix_cache_backend="hicache_ext",
    )


def test_preflight_refuses_a_disk_dir_claimed_by_another_live_server(tmp_path: Path) -> None:
    # Imported here: spawned children import this module, and need not load SGLang.
    from sglang_hicache_ext.sglang_ext.disk_tier import dir_claim
    from sglang_hicache_ext.sglang_ext.server.preflight import PreflightError, check_disk_tier

    disk_dir = tmp_path / "disk"
    disk_dir.mkdir()
    other = _holder(disk_dir, dir_claim.SERVER_LOCK_NAME)  # as the other launcher does
    try:
        with pytest.raises(PreflightError) as caught:
            check_disk_tier(_disk_tier_args(disk_dir))
        message = str(caught.value)
        assert f"disk_dir {disk_dir.absolute()} is in use by another server" in message
        assert f"process {other.pid}" in message and "\n" not in message
    finally:
        os.kill(other.pid, signal.SIGKILL)
        other.wait(30)
    try:
        check_disk_tier(_disk_tier_args(disk_dir))  # the holder is gone: claimed by us
        check_disk_tier(_disk_tier_args(disk_dir))  # again in the same process: re-entrant
        with pytest.raises(DirectoryLockedError):
            DirectoryLock(disk_dir, dir_claim.SERVER_LOCK_NAME)
    finally:
        dir_claim.release_disk_dir(disk_dir)
    DirectoryLock(disk_dir, dir_claim.SERVER_LOCK_NAME).release()
