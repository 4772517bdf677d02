"""Disk tier: TTL expiry and refresh, capacity, checksums, concurrency, pinning while reading."""

from __future__ import annotations

import errno
import random
import threading
from pathlib import Path

import pytest

import sglang_hicache_ext.tiers.atomic_write as atomic_write
from sglang_hicache_ext.tiers.atomic_write import TEMP_SUFFIX
from sglang_hicache_ext.tiers.pages.page_store import PageStore
from sglang_hicache_ext.tiers.pages.ttl_policy import TtlPolicy, TtlTable


class FakeClock:
    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_store(
    root: Path, capacity: int = 1 << 20, clock: FakeClock | None = None, **ttls: float
) -> PageStore:
    table = TtlTable(default_ttl=ttls.pop("default", 10.0), ttls=ttls)
    return PageStore(root, capacity, TtlPolicy(table), clock or FakeClock())


def page_files(root: Path) -> list[Path]:
    return [p for p in (root / "pages").rglob("*") if p.is_file()]


def test_ttl_expiry_and_refresh_on_access(tmp_path: Path) -> None:
    clock = FakeClock(1_000.0)
    store = make_store(tmp_path, clock=clock, default=10.0, hot=100.0)
    assert store.put("a" * 64, b"cold", group="residual")
    assert store.put("b" * 64, b"hot", group="hot")
    assert store.info("a" * 64).expiry == 1_010.0
    assert store.info("b" * 64).expiry == 1_100.0

    clock.now = 1_008.0
    assert store.get("a" * 64) == b"cold"  # refresh: expiry moves to 1018
    assert store.info("a" * 64).expiry == 1_018.0
    clock.now = 1_018.0
    assert store.contains("a" * 64)  # live up to and including the expiry instant
    clock.now = 1_018.5
    assert store.get("a" * 64) is None
    assert store.get("b" * 64) == b"hot"
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.expired, stats.entries) == (2, 1, 1, 1)
    assert len(page_files(tmp_path)) == 1  # the expired file is gone


def test_purge_expired_and_unknown_key(tmp_path: Path) -> None:
    clock = FakeClock()
    store = make_store(tmp_path, clock=clock, default=5.0)
    for i in range(4):
        clock.now = 1_000.0 + i
        store.put(f"k{i}", bytes([i]) * 10)
    clock.now = 1_006.5  # k0 (1005) and k1 (1006) expired; k2 (1007), k3 (1008) live
    assert store.purge_expired() == 2
    assert store.stats().entries == 2
    assert store.get("never-stored") is None
    with pytest.raises(ValueError):
        store.get("")


def test_capacity_evicts_soonest_expiry_first(tmp_path: Path) -> None:
    clock = FakeClock()
    probe = make_store(tmp_path / "probe")
    probe.put("x", b"\0" * 1000, group="long")
    page = probe.stats().used_bytes  # one 1000-byte page with its header
    store = make_store(tmp_path / "s", capacity=3 * page, clock=clock, default=10.0, long=50.0)
    store.put("x", b"1" * 1000, group="long")  # expires 1050
    store.put("y", b"2" * 1000, group="rest")  # expires 1010
    clock.now = 1_001.0
    store.put("z", b"3" * 1000, group="rest")  # expires 1011
    assert store.stats().used_bytes == 3 * page
    store.put("w", b"4" * 1000, group="rest")
    assert not store.contains("y") and store.contains("x") and store.contains("z")
    assert store.stats().used_bytes == 3 * page and store.stats().evicted == 1
    assert not store.put("huge", b"5" * (3 * page))  # larger than the whole store
    assert store.stats().rejected_writes == 1 and store.get("x") == b"1" * 1000


def test_corrupt_payload_is_never_served(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    store.put("good", b"g" * 4096)
    store.put("bad", b"b" * 4096)
    (path,) = [p for p in page_files(tmp_path) if p == store._path_of("bad")]
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # flip one payload bit pattern
    path.write_bytes(bytes(data))
    assert store.get("bad") is None
    assert store.stats().corrupt_pages == 1
    assert not path.exists() and store.info("bad") is None
    assert store.get("good") == b"g" * 4096


def test_full_disk_keeps_old_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = make_store(tmp_path)
    assert store.put("k", b"old")

    def no_space(fd: int, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic_write, "_write_all", no_space)
    assert not store.put("k", b"new")
    monkeypatch.undo()
    stats = store.stats()
    assert stats.write_errors == 1 and stats.reserved_bytes == 0
    assert not [p for p in page_files(tmp_path) if p.name.endswith(TEMP_SUFFIX)]
    assert store.get("k") == b"old"


def test_restart_rebuilds_index_and_keeps_ttl(tmp_path: Path) -> None:
    clock = FakeClock(1_000.0)
    store = make_store(tmp_path, clock=clock, default=10.0)
    store.put("a", b"A" * 100)
    store.put("b", b"B" * 200)
    clock.now = 1_008.0
    store.get("a")  # last access 1008 persisted in the file's mtime
    size_a = store.info("a").size_bytes
    store.close()  # one open store per folder: the restart takes it over
    clock.now = 1_015.0  # b (written 1000) expired, a (read 1008) live until 1018
    reopened = make_store(tmp_path, clock=clock, default=10.0)
    assert reopened.stats().used_bytes == size_a and reopened.stats().expired == 1
    assert reopened.get("a") == b"A" * 100
    assert reopened.get("b") is None
    assert reopened.info("a").expiry == 1_025.0  # refreshed by the read at 1015
    assert reopened.stats().entries == 1


def test_capacity_never_exceeded_under_concurrent_writes(tmp_path: Path) -> None:
    capacity = 64 * 1024
    store = make_store(tmp_path, capacity=capacity, default=1e6)
    stop = threading.Event()
    worst: list[int] = []
    errors: list[BaseException] = []

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for i in range(40):
                key = f"w{seed}-{rng.randrange(30)}"
                store.put(key, bytes([i % 256]) * rng.randrange(500, 9000))
                if rng.random() < 0.3:
                    store.get(key)
        except BaseException as error:  # surfaced below: a thread must not die silently
            errors.append(error)

    def monitor() -> None:
        try:
            while not stop.is_set():
                stats = store.stats()
                worst.append(max(store.disk_usage_bytes(), stats.used_bytes + stats.reserved_bytes))
        except BaseException as error:
            errors.append(error)

    watcher = threading.Thread(target=monitor)
    watcher.start()
    writers = [threading.Thread(target=writer, args=(seed,)) for seed in range(6)]
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    stop.set()
    watcher.join()
    assert not errors
    assert worst and max(worst) <= capacity
    stats = store.stats()
    assert stats.evicted > 0  # the load really did overflow the store
    assert stats.used_bytes == sum(p.stat().st_size for p in page_files(tmp_path)) <= capacity
    assert stats.reserved_bytes == 0


class PausingStore(PageStore):
    """Blocks inside the file read until released, to act while a reader holds a page."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.reading = threading.Event()
        self.release = threading.Event()
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def _read_file(self, entry):  # type: ignore[no-untyped-def]
        self.reading.set()
        assert self.release.wait(10)
        return super()._read_file(entry)


def test_expiry_and_eviction_never_remove_a_page_being_read(tmp_path: Path) -> None:
    clock = FakeClock(1_000.0)
    probe = make_store(tmp_path / "probe")
    probe.put("p", b"\0" * 1000)
    page = probe.stats().used_bytes
    store = PausingStore(tmp_path / "s", page, TtlPolicy(TtlTable(default_ttl=10.0)), clock)
    store.put("p", b"x" * 1000)
    result: list[bytes | None] = []
    reader = threading.Thread(target=lambda: result.append(store.get("p")))
    reader.start()
    assert store.reading.wait(10)

    clock.now = 2_000.0  # far past the expiry set by the read (1010)
    assert store.purge_expired() == 0
    assert not store.put("q", b"y" * 1000)  # the only evictable page is being read
    assert store._path_of("p").exists()

    store.release.set()
    reader.join()
    assert result == [b"x" * 1000]
    assert not store._path_of("p").exists()  # deleted when the last reader left
    assert store.stats().entries == 0 and store.stats().used_bytes == 0
    assert store.put("q", b"y" * 1000)


def test_writer_ttl_and_touch_refresh_with_group_change(tmp_path: Path) -> None:
    clock = FakeClock(1_000.0)
    store = make_store(tmp_path, clock=clock, default=10.0, hot=100.0)
    assert store.put("a" * 64, b"page", group="residual", ttl_s=3.0)  # the writer's TTL wins
    assert store.info("a" * 64).expiry == 1_003.0
    with pytest.raises(ValueError, match="ttl_s"):
        store.put("b" * 64, b"page", ttl_s=-1.0)

    clock.now = 1_002.0
    # An access served by a faster tier: the page moves to its current group, TTL from it.
    assert store.touch(["a" * 64, "missing"], groups=["hot", "hot"]) == 1
    info = store.info("a" * 64)
    assert (info.group, info.last_access, info.expiry) == ("hot", 1_002.0, 1_102.0)
    assert store.group_usage() == {"hot": {"pages": 1, "bytes": info.size_bytes}}
    assert store.stats().refreshes == 1

    clock.now = 1_200.0  # expired: touch does not revive it
    assert store.touch(["a" * 64]) == 0
    assert not store.contains("a" * 64)
    with pytest.raises(ValueError, match="groups"):
        store.touch(["a" * 64], groups=[])


def test_touch_persists_last_access_across_restart(tmp_path: Path) -> None:
    clock = FakeClock(1_000.0)
    store = make_store(tmp_path, clock=clock, default=10.0)
    assert store.put("a" * 64, b"page")
    clock.now = 1_008.0
    store.touch(["a" * 64])
    store.close()
    clock.now = 1_015.0  # past the write's expiry (1010), within the touch's (1018)
    reopened = make_store(tmp_path, clock=clock, default=10.0)
    assert reopened.get("a" * 64) == b"page"
