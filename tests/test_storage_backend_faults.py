"""The disk tier's SGLang backend off the server: no exception ever reaches the caller, one
backend per shard folder, and the TTL access history survives a close, a crash and corruption.

The host KV pool is a stand-in with the four members the backend uses; everything below it
(disk store, files, locks, history file) is real. The end-to-end tests run the real pool.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

import sglang_hicache_ext.tiers.pages.page_store as page_store
from sglang_hicache_ext.sglang_ext.config.disk_tier_settings import disk_tier_extra_config
from sglang_hicache_ext.sglang_ext.disk_tier.history import HISTORY_FILE_NAME
from sglang_hicache_ext.sglang_ext.disk_tier.storage_backend import GroupTTLDiskStorage
from sglang_hicache_ext.tiers.dir_lock import DirectoryLockedError

REPO = Path(__file__).resolve().parent.parent
PAGE_SIZE = 4  # tokens per page
PAGE_FLOATS = 16


class HostPool:
    """Stand-in for SGLang's host KV pool: one float32 row of `PAGE_FLOATS` per page."""

    page_size = PAGE_SIZE

    def __init__(self, pages: int = 32) -> None:
        self.rows = torch.arange(pages * PAGE_FLOATS, dtype=torch.float32).view(pages, -1)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self.rows[index // PAGE_SIZE]

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(PAGE_FLOATS, dtype=torch.float32)

    def set_from_flat_data_page(self, index: int, page: torch.Tensor) -> None:
        self.rows[index // PAGE_SIZE].copy_(page.view(torch.float32))


def storage_config(disk_dir: Path, **options: Any) -> HiCacheStorageConfig:
    extra = {
        **disk_tier_extra_config(str(disk_dir)),
        "capacity_bytes": 1e6,
        "ttl_period_s": 3600,
        **options,
    }
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name="org/tiny",
        extra_config=extra,
    )


def open_backend(disk_dir: Path, **options: Any) -> GroupTTLDiskStorage:
    backend = GroupTTLDiskStorage(storage_config(disk_dir, **options))
    backend.register_mem_pool_host(HostPool())  # type: ignore[arg-type]
    return backend


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[GroupTTLDiskStorage]:
    opened = open_backend(tmp_path)
    yield opened
    opened.close()


def host_indices(pages: int) -> torch.Tensor:
    return torch.arange(pages * PAGE_SIZE)


def keys(n: int, prefix: str = "k") -> list[str]:
    return [f"{prefix}{i:062d}" for i in range(n)]


def _boom(*args: object, **kwargs: object) -> None:
    raise RuntimeError("injected")


ENTRY_POINTS: dict[str, tuple[str, Callable[[GroupTTLDiskStorage], Any], Any, str]] = {
    # entry point: (store method made to fail, call, fallback, whose count grows)
    "batch_set_v1": (
        "put",
        lambda b: b.batch_set_v1(keys(3), host_indices(3)),
        [False] * 3,
        "batch_set_v1",
    ),
    "batch_get_v1": (
        "get",
        lambda b: b.batch_get_v1(keys(3), host_indices(3)),
        [False] * 3,
        "batch_get_v1",
    ),
    "batch_exists": ("contains", lambda b: b.batch_exists(keys(3)), 0, "batch_exists"),
    "exists": ("contains", lambda b: b.exists(keys(1)[0]), False, "exists"),
    "touch": ("touch", lambda b: b.touch(keys(2), ["residual"] * 2), 0, "touch"),
    "get": ("get", lambda b: b.get(keys(1)[0], torch.zeros(PAGE_FLOATS)), None, "get"),
    # The batch variants go through get / set, which answer each page.
    "batch_get": (
        "get",
        lambda b: b.batch_get(keys(2), [torch.zeros(PAGE_FLOATS)] * 2),
        [None, None],
        "get",
    ),
    "set": ("put", lambda b: b.set(keys(1)[0], torch.zeros(PAGE_FLOATS)), False, "set"),
    "batch_set": (
        "put",
        lambda b: b.batch_set(keys(2), [torch.zeros(PAGE_FLOATS)] * 2),
        False,
        "set",
    ),
    "clear": ("infos", lambda b: b.clear(), None, "clear"),
}


@pytest.mark.parametrize("entry_point", list(ENTRY_POINTS))
def test_every_entry_point_turns_an_exception_into_a_miss(
    backend: GroupTTLDiskStorage, monkeypatch: pytest.MonkeyPatch, entry_point: str
) -> None:
    store_method, call, fallback, counted_as = ENTRY_POINTS[entry_point]
    assert backend.batch_set_v1(keys(3), host_indices(3)) == [True] * 3
    monkeypatch.setattr(backend.store, store_method, _boom)
    assert call(backend) == fallback
    exceptions = backend.status()["errors"]["exceptions"]
    assert exceptions[counted_as] >= 1, exceptions
    assert sum(exceptions.values()) == exceptions[counted_as], exceptions


def test_bad_arguments_from_the_caller_are_a_miss_too(backend: GroupTTLDiskStorage) -> None:
    assert backend.batch_set_v1(["", keys(1)[0]], host_indices(2)) == [False, True]
    assert backend.touch(keys(2), groups=["one"]) == 0  # lengths differ
    assert backend.batch_exists(None) == 0  # type: ignore[arg-type]
    exceptions = backend.status()["errors"]["exceptions"]
    assert (exceptions["batch_set_v1"], exceptions["touch"], exceptions["batch_exists"]) == (
        1,
        1,
        1,
    )


def test_storage_faults_are_false_not_exceptions(
    backend: GroupTTLDiskStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    def eio(directory: Path) -> None:
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(page_store, "fsync_directory", eio)
    assert backend.batch_set_v1(keys(2), host_indices(2)) == [False, False]
    monkeypatch.undo()
    status = backend.status()
    assert status["disk"]["write_errors"] == 2 and status["disk"]["entries"] == 0
    assert sum(status["errors"]["exceptions"].values()) == 0  # handled, not an exception
    assert backend.batch_exists(keys(2)) == 0
    assert backend.batch_set_v1(keys(2), host_indices(2)) == [True, True]
    assert backend.batch_exists(keys(2)) == 2


def test_one_backend_per_shard_folder_and_close_releases_it(tmp_path: Path) -> None:
    first = open_backend(tmp_path)
    with pytest.raises(DirectoryLockedError, match=str(os.getpid())):
        open_backend(tmp_path)
    first.close()
    first.close()  # idempotent
    assert not first._maintenance.is_alive()
    assert first.online._thread is None or not first.online._thread.is_alive()
    assert first.batch_set_v1(keys(1), host_indices(1)) == [False]  # closed: refused, no raise
    second = open_backend(tmp_path)
    second.close()


def _record(backend: GroupTTLDiskStorage, requests: int) -> None:
    shared = keys(2, "s")
    for i in range(requests):
        backend.online.record([*shared, *keys(3, f"d{i % 3}-")], device_pages=1)


def test_history_round_trip_through_close_and_reopen(tmp_path: Path) -> None:
    first = open_backend(tmp_path)
    _record(first, 12)
    assert first.batch_set_v1(keys(2), host_indices(2)) == [True, True]  # page size known
    assert first.online.replan() is not None
    recorded = first.status()["ttl"]
    first.close()  # saves

    second = open_backend(tmp_path)
    try:
        history = second.status()["ttl_history"]
        assert history["reloaded_page_accesses"] == recorded["window_page_accesses"] == 12 * 5
        assert history["reloaded_requests"] == 12 and history["reloaded_plan"]
        assert history["load_error"] is None
        assert second.online.status()["bytes_per_page"] == PAGE_FLOATS * 4
        assert second.online.policy.table.as_dict() == recorded["ttls"]
        assert second.online.replan() is not None  # no new access needed to plan
    finally:
        second.close()


def test_corrupt_history_is_counted_and_ignored(tmp_path: Path) -> None:
    first = open_backend(tmp_path)
    _record(first, 3)
    first.close()
    path = Path(first.store.root) / HISTORY_FILE_NAME
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    stray = path.with_name(f".{path.name}.dead.tmp")
    stray.write_bytes(b"an interrupted save")

    second = open_backend(tmp_path)
    status = second.status()
    assert status["errors"]["history_load_errors"] == 1
    assert "corrupt" in status["ttl_history"]["load_error"]
    assert status["ttl_history"]["reloaded_page_accesses"] == 0
    assert status["ttl"]["window_page_accesses"] == 0
    assert not stray.exists()
    _record(second, 2)
    second.close()  # the next save replaces the corrupt file
    third = open_backend(tmp_path)
    assert third.status()["ttl_history"]["reloaded_page_accesses"] == 2 * 5
    third.close()


def test_history_is_saved_periodically(tmp_path: Path) -> None:
    backend = open_backend(tmp_path, ttl_history_save_s=0.1, purge_interval_s=0.05)
    try:
        _record(backend, 4)
        deadline = time.monotonic() + 10
        while backend.status()["ttl_history"]["saved_page_accesses"] != 4 * 5:
            assert time.monotonic() < deadline, backend.status()["ttl_history"]
            time.sleep(0.05)
        saved_at = backend.status()["ttl_history"]["saved_at_s"]
        time.sleep(0.3)  # nothing new: nothing saved again
        assert backend.status()["ttl_history"]["saved_at_s"] == saved_at
    finally:
        backend.close()


CRASHER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {repo!r})
    from pathlib import Path
    from tests.test_storage_backend_faults import open_backend, keys
    backend = open_backend(Path({root!r}), ttl_history_save_s=0.05, purge_interval_s=0.01)
    i = 0
    while True:
        backend.online.record(keys(3, f"r{{i}}-"))
        i += 1
        saved = backend.status()["ttl_history"]["saved_page_accesses"]
        print(saved, flush=True)
        time.sleep(0.002)
    """
)


def test_history_survives_sigkill_during_saves(tmp_path: Path) -> None:
    """Killed while recording and saving every 50 ms: the restart loads an intact history with
    at least everything reported saved."""
    child = subprocess.Popen(
        [sys.executable, "-c", CRASHER.format(repo=str(REPO), root=str(tmp_path))],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert child.stdout is not None
    saved = 0
    deadline = time.monotonic() + 120
    while saved < 300 and time.monotonic() < deadline:
        line = child.stdout.readline()
        assert line, "the child exited"
        saved = max(saved, int(line))
    os.kill(child.pid, signal.SIGKILL)
    child.wait(30)
    assert saved >= 300

    backend = open_backend(tmp_path)
    try:
        history = backend.status()["ttl_history"]
        assert history["load_error"] is None
        assert history["reloaded_page_accesses"] >= saved
        assert backend.status()["errors"]["history_load_errors"] == 0
    finally:
        backend.close()
