"""Crash safety: partial files and a writer killed with SIGKILL leave a store that restarts clean."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from sglang_hicache_ext.tiers.atomic_write import TEMP_SUFFIX
from sglang_hicache_ext.tiers.pages.page_store import PageStore
from sglang_hicache_ext.tiers.pages.ttl_policy import TtlPolicy, TtlTable

REPO = Path(__file__).resolve().parent.parent
PAGE_BYTES = 256 * 1024


def expected_value(key: str) -> bytes:
    """Deterministic page content, so a reopened store can be checked byte for byte."""
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (PAGE_BYTES // len(seed) + 1))[:PAGE_BYTES]


def open_store(root: Path) -> PageStore:
    return PageStore(root, 1 << 30, TtlPolicy(TtlTable(default_ttl=1e9)))


def assert_serves_only_intact_pages(store: PageStore, keys: list[str]) -> int:
    served = 0
    for key in keys:
        value = store.get(key)
        if value is not None:
            assert value == expected_value(key)
            served += 1
    return served


def test_forced_partial_files_are_dropped_on_restart(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(4)]
    for key in keys:
        assert store.put(key, expected_value(key))
    truncated = store._path_of(keys[0])
    truncated.write_bytes(truncated.read_bytes()[: PAGE_BYTES // 2])  # torn page
    header_only = store._path_of(keys[1])
    header_only.write_bytes(header_only.read_bytes()[:20])  # torn header
    flipped = store._path_of(keys[2])
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01  # silent corruption: only the payload CRC can tell
    flipped.write_bytes(bytes(data))
    stray = truncated.with_name(f".{truncated.name}.deadbeef{TEMP_SUFFIX}")
    stray.write_bytes(b"half a page")
    del store

    reopened = open_store(tmp_path)
    stats = reopened.stats()
    assert stats.removed_temp_files == 1 and not stray.exists()
    assert stats.corrupt_pages == 2  # the two torn files, caught by the header/length check
    assert stats.entries == 2
    assert reopened.get(keys[2]) is None  # payload CRC fails on read: dropped, not served
    assert reopened.get(keys[3]) == expected_value(keys[3])
    assert reopened.stats().corrupt_pages == 3 and reopened.stats().entries == 1


WRITER = textwrap.dedent(
    """
    import hashlib, sys
    sys.path.insert(0, {repo!r})
    from tests.test_disk_store_crash import expected_value, open_store
    from pathlib import Path
    store = open_store(Path({root!r}))
    i = 0
    while True:
        key = hashlib.sha256(str(i % 40).encode()).hexdigest()  # overwrites too, after 40
        store.put(key, expected_value(key))
        print(i, flush=True)
        i += 1
    """
)


def test_sigkill_during_writes_leaves_a_consistent_store(tmp_path: Path) -> None:
    root = tmp_path / "store"
    script = WRITER.format(repo=str(REPO), root=str(root))
    confirmed = -1
    for _round in range(2):  # kill it twice: the second run starts from a crashed store
        child = subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO
        )
        assert child.stdout is not None
        target = confirmed + 25
        while confirmed < target:
            line = child.stdout.readline()
            assert line, "writer exited early"
            confirmed = max(confirmed, int(line))
        os.kill(child.pid, signal.SIGKILL)  # lands in the middle of the next put
        child.wait(timeout=30)
        assert child.returncode == -signal.SIGKILL

    store = open_store(root)
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(40)]
    assert not [p for p in (root / "pages").rglob(f"*{TEMP_SUFFIX}")]
    # Every put that returned before the kill is durable and intact.
    served = assert_serves_only_intact_pages(store, keys)
    assert served >= min(confirmed + 1, 40)
    assert store.stats().corrupt_pages == 0
    on_disk = sum(p.stat().st_size for p in (root / "pages").rglob("*") if p.is_file())
    assert store.stats().used_bytes == on_disk
