"""Disk store under OS faults and shared folders: `put` never raises for a storage fault, the
index always matches what it returned, and a second store never touches the first one's files."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

import sglang_hicache_ext.tiers.pages.page_store as page_store
from sglang_hicache_ext.tiers.atomic_write import TEMP_SUFFIX
from sglang_hicache_ext.tiers.dir_lock import DirectoryLockedError
from tests.test_disk_store import FakeClock, make_store, page_files

REPO = Path(__file__).resolve().parent.parent
KEY = "k" * 64


def _eio(*args: object, **kwargs: object) -> None:
    raise OSError(errno.EIO, "Input/output error (injected)")


def _assert_consistent(store: page_store.PageStore, root: Path) -> None:
    """The index and the folder agree: no temp file left, bytes accounted = bytes on disk."""
    stats = store.stats()
    files = page_files(root)
    assert not [p for p in files if p.name.endswith(TEMP_SUFFIX)]
    assert stats.reserved_bytes == 0
    assert stats.used_bytes == sum(p.stat().st_size for p in files)
    assert stats.entries == len(files)


# Faults before the rename: the old page stays.
BEFORE_RENAME: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "mkdir": lambda mp: mp.setattr(os, "mkdir", _eio),
    "file fsync": lambda mp: mp.setattr(os, "fsync", _eio),
    "rename": lambda mp: mp.setattr(os, "replace", _eio),
    "no space": lambda mp: mp.setattr(os, "write", lambda *a: _eio()),
}


@pytest.mark.parametrize("fault", list(BEFORE_RENAME))
def test_fault_before_the_rename_keeps_the_old_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    store = make_store(tmp_path)
    assert store.put(KEY, b"old")
    key = KEY
    if fault == "mkdir":  # only a page in a folder that does not exist yet needs a mkdir
        folder = store._path_of(KEY).parent
        key = next(f"n{i}" for i in range(1000) if store._path_of(f"n{i}").parent != folder)
        assert not store._path_of(key).parent.exists()
    BEFORE_RENAME[fault](monkeypatch)
    assert store.put(key, b"new") is False  # no exception
    monkeypatch.undo()
    assert store.stats().write_errors == 1
    assert store.get(KEY) == b"old"
    assert store.get(key) == (b"old" if key == KEY else None)
    _assert_consistent(store, tmp_path)


@pytest.mark.parametrize("had_old_page", [False, True])
def test_directory_fsync_failure_after_the_rename_unindexes_the_new_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, had_old_page: bool
) -> None:
    """The rename happened but may not be durable: put returns False, and the key has no page
    (the old file was already replaced; the new one is removed, not served)."""
    store = make_store(tmp_path)
    assert store.put("other", b"stays")
    if had_old_page:
        assert store.put(KEY, b"old")
    monkeypatch.setattr(page_store, "fsync_directory", _eio)
    assert store.put(KEY, b"new") is False
    monkeypatch.undo()
    stats = store.stats()
    assert stats.write_errors == 1
    assert store.info(KEY) is None and store.get(KEY) is None
    assert not store._path_of(KEY).exists()
    assert store.get("other") == b"stays"
    _assert_consistent(store, tmp_path)
    assert store.put(KEY, b"again") and store.get(KEY) == b"again"  # the key works afterwards


def test_directory_fsync_failure_while_the_new_page_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader that got the new page before the fsync failed keeps it; the file goes when
    the reader leaves (the pinning rule), and no later reader gets it."""
    store = make_store(tmp_path)
    entries: list[object] = []

    def fail_after_pinning(directory: Path) -> None:
        entry = store._entries[KEY]
        entry.readers += 1  # as a concurrent get() between the rename and the fsync would
        entries.append(entry)
        _eio()

    monkeypatch.setattr(page_store, "fsync_directory", fail_after_pinning)
    assert store.put(KEY, b"new") is False
    monkeypatch.undo()
    assert store._path_of(KEY).exists() and store.get(KEY) is None  # doomed: never served again
    with store._lock:
        entries[0].readers -= 1  # type: ignore[attr-defined]
        store._release_if_doomed(entries[0])  # type: ignore[arg-type]
    assert not store._path_of(KEY).exists()
    _assert_consistent(store, tmp_path)


def test_invalid_arguments_raise_before_anything_is_touched(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    for bad in (lambda: store.put("", b"x"), lambda: store.put(KEY, b"x", ttl_s=float("nan"))):
        with pytest.raises(ValueError):
            bad()
    assert store.stats().entries == 0 and not page_files(tmp_path)


def test_folder_removed_under_a_running_store(tmp_path: Path) -> None:
    """Someone deletes the pages: reads miss (counted), writes recreate the folder, purge and
    touch keep working; nothing raises."""
    clock = FakeClock()
    store = make_store(tmp_path, clock=clock, default=5.0)
    for i in range(3):
        assert store.put(f"p{i}", b"x" * 100)
    shutil.rmtree(tmp_path / "pages")
    assert store.get("p0") is None
    assert store.stats().io_errors == 1
    assert store.touch(["p1", "p2"]) == 2  # only the index and the (missing) files' mtime
    clock.now += 60
    assert store.purge_expired() == 2
    assert store.disk_usage_bytes() == 0
    assert store.put("p9", b"back")
    assert store.get("p9") == b"back"
    _assert_consistent(store, tmp_path)


def test_open_skips_unreadable_files_and_counts_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store(tmp_path)
    for key in ("a", "b"):
        assert store.put(key, b"v" * 50)
    store.close()
    broken = store._path_of("a")
    real_open = open

    def failing_open(path: object, *args: object, **kwargs: object) -> object:
        if Path(str(path)) == broken:
            _eio()
        return real_open(path, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr("builtins.open", failing_open)
    monkeypatch.setattr(page_store, "fsync_directory", _eio)
    reopened = make_store(tmp_path)  # no exception although a file and the fsync fail
    monkeypatch.undo()
    stats = reopened.stats()
    assert stats.io_errors == 2 and stats.corrupt_pages == 0
    assert reopened.get("b") == b"v" * 50 and reopened.get("a") is None


def test_closed_store_refuses_writes_and_deletes_nothing(tmp_path: Path) -> None:
    clock = FakeClock()
    store = make_store(tmp_path, clock=clock, default=5.0)
    assert store.put("a", b"1")
    store.close()
    store.close()
    assert store.closed
    assert store.put("b", b"2") is False and store.stats().rejected_writes == 1
    assert store.get("a") == b"1"  # reading is harmless
    clock.now += 60
    store.purge_expired()  # the folder may have a new owner: its files are not ours to delete
    assert store._path_of("a").exists()
    with make_store(tmp_path, clock=clock) as successor:  # the lock was released
        assert successor.stats().entries == 0  # expired at open, by the successor
    assert not store._path_of("a").exists()


OWNER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {repo!r})
    from pathlib import Path
    from sglang_hicache_ext.tiers.pages.page_store import PageStore
    from sglang_hicache_ext.tiers.atomic_write import TEMP_SUFFIX
    from sglang_hicache_ext.tiers.pages.ttl_policy import TtlPolicy, TtlTable
    store = PageStore({root!r}, 1 << 20, TtlPolicy(TtlTable(default_ttl=1e6)))
    assert store.put("kept", b"mine")
    # A write in flight: its temp file exists until the rename.
    path = store._path_of("in-flight")
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / ("." + path.name + ".feed" + TEMP_SUFFIX)).write_bytes(b"half")
    print("open", flush=True)
    sys.stdin.read()
    """
)


def test_second_store_on_the_same_folder_fails_and_touches_nothing(tmp_path: Path) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER.format(repo=str(REPO), root=str(tmp_path))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert owner.stdout is not None
    try:
        assert owner.stdout.readline().strip() == "open"
        temp = [p for p in page_files(tmp_path) if p.name.endswith(TEMP_SUFFIX)]
        assert len(temp) == 1
        with pytest.raises(DirectoryLockedError) as caught:
            make_store(tmp_path)
        assert str(tmp_path) in str(caught.value) and str(owner.pid) in str(caught.value)
        assert temp[0].exists()  # the owner's write in flight survived
    finally:
        assert owner.stdin is not None
        owner.stdin.close()
        owner.wait(60)
    assert owner.returncode == 0
    store = make_store(tmp_path)  # the owner exited: its leftovers are now stray
    assert store.stats().removed_temp_files == 1 and store.get("kept") == b"mine"
