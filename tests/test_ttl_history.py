"""The TTL optimiser's history across a restart: file round trip, plans identical to those
without the restart, and corrupt or incompatible files refused (never half-loaded)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from sglang_hicache_ext.radix.groups import RESIDUAL_GROUP
from sglang_hicache_ext.tuning.ttl.history_file import (
    MAGIC,
    HistoryFileError,
    encode_history,
    load_history,
    save_history,
    stray_temp_files,
)
from sglang_hicache_ext.tuning.ttl.online import OnlineTtl, OnlineTtlConfig
from tests.test_ttl_online import FakeClock, _path, _planted

CONFIG = OnlineTtlConfig(policy="group", top_k=2, disk_budget_bytes=14 * 1000.0, window_s=1e6)


def _planted_online(clock: FakeClock, config: OnlineTtlConfig = CONFIG) -> OnlineTtl:
    online = OnlineTtl(config, clock=clock)
    _planted(online, clock)  # 80 requests of 6 pages, t = 0 .. 390 s
    online.set_page_bytes(1000)
    return online


def test_file_round_trip_is_exact(tmp_path: Path) -> None:
    clock = FakeClock()
    online = _planted_online(clock)
    assert online.replan() is not None
    history = online.history()
    path = tmp_path / "history.bin"
    size = save_history(path, history)
    assert size == path.stat().st_size and not stray_temp_files(path)
    assert load_history(path) == history  # times, paths, page size, plan: all exact
    assert history.page_accesses == 80 * 6 == online.status()["window_page_accesses"]
    assert load_history(tmp_path / "missing.bin") is None


def test_restored_server_plans_exactly_as_if_it_had_not_stopped(tmp_path: Path) -> None:
    clock = FakeClock()
    before = _planted_online(clock)
    before.replan()
    path = tmp_path / "history.bin"
    save_history(path, before.history())
    loaded = load_history(path)
    assert loaded is not None

    clock.now = 400.0  # restarted 10 s after the last request
    after = OnlineTtl(CONFIG, clock=clock)
    restored = after.restore(loaded)
    assert restored == (80, 480, True)
    status = after.status()
    assert status["window_page_accesses"] == 480 and status["window_requests"] == 80
    assert status["bytes_per_page"] == 1000 and status["restored_plan_at_s"] == 390.0
    # The last plan is in force at once: same groups and TTLs as before the stop.
    assert after.groups_of(_path("hot-a")) == before.groups_of(_path("hot-a"))
    assert after.policy.table == before.policy.table
    # The next plan sees every access from before the restart.
    plan_after = after.replan(now=400.0)
    plan_before = before.replan(now=400.0)
    assert plan_after is not None and plan_before is not None
    assert (plan_after.choice, plan_after.ttls, plan_after.groups) == (
        plan_before.choice,
        plan_before.ttls,
        plan_before.groups,
    )
    # Recording goes on after the restored requests, also if the clock stepped back.
    clock.now = 300.0
    assert after.record(_path("hot-a")) == before.groups_of(_path("hot-a"))
    assert after.status()["record_errors"] == 0


def test_restore_keeps_only_the_window_and_compatible_plans(tmp_path: Path) -> None:
    clock = FakeClock()
    before = _planted_online(clock)
    before.replan()
    history = before.history()

    clock.now = 500.0  # window 300 s: requests before t = 200 are out
    short = OnlineTtl(OnlineTtlConfig(policy="group", window_s=300.0), clock=clock)
    requests, accesses, plan_restored = short.restore(history)
    assert requests == 2 * 20 and accesses == 6 * requests and plan_restored

    clock.now = 390.0 + 2e6  # the plan is older than the window: not put back
    stale = OnlineTtl(CONFIG, clock=clock)
    assert stale.restore(history) == (0, 0, False)
    assert stale.policy.table == CONFIG.initial_table()

    clock.now = 400.0
    for other in (OnlineTtlConfig(policy="fixed", window_s=1e6), OnlineTtlConfig(policy="static")):
        online = OnlineTtl(other, clock=clock)
        assert online.restore(history).plan_restored is False  # another policy's TTLs
        assert online.policy.table == other.initial_table()

    capped = OnlineTtl(OnlineTtlConfig(policy="group", window_s=1e6, max_ttl_s=1.0), clock=clock)
    capped.restore(history)
    assert max(capped.policy.table.as_dict().values()) <= 1.0

    busy = OnlineTtl(CONFIG, clock=clock)
    busy.record(_path("x"))
    with pytest.raises(ValueError, match="before the first recorded request"):
        busy.restore(history)


def test_restored_page_size_gives_way_to_the_measured_one() -> None:
    clock = FakeClock()
    history = _planted_online(clock).history()
    online = OnlineTtl(CONFIG, clock=clock)
    online.restore(history)
    assert online.status()["bytes_per_page"] == 1000
    online.set_page_bytes(400)  # e.g. another dtype since the restart
    assert online.status()["bytes_per_page"] == 400


def _corruptions(good: bytes) -> dict[str, bytes]:
    body = json.loads(zlib.decompress(good[len(MAGIC) :]))

    def rewritten(**changes: object) -> bytes:
        return MAGIC + zlib.compress(json.dumps({**body, **changes}).encode())

    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x10
    return {
        "empty": b"",
        "truncated": good[: len(good) - 7],
        "bit flip": bytes(flipped),
        "other magic": b"not a history" + good[len(MAGIC) :],
        "not json": MAGIC + zlib.compress(b"{nope"),
        "newer version": rewritten(version=2),
        "other format": rewritten(format="something else"),
        "unknown page": rewritten(requests=[[1.0, [10_000]]]),
        "out of order": rewritten(requests=[[2.0, [0]], [1.0, [0]]]),
        "infinite time": MAGIC
        + zlib.compress(json.dumps({**body, "requests": [[float("inf"), [0]]]}).encode()),
        "negative TTL": rewritten(plan={**body["plan"], "default_ttl_s": -1}),
        "missing field": rewritten(bytes_per_page=None),
        "wrong shape": rewritten(requests=[[1.0]]),
    }


def test_corrupt_or_incompatible_files_are_refused(tmp_path: Path) -> None:
    clock = FakeClock()
    online = _planted_online(clock)
    online.replan()
    good = MAGIC + encode_history(online.history())
    for name, data in _corruptions(good).items():
        path = tmp_path / f"{name}.bin"
        path.write_bytes(data)
        with pytest.raises(HistoryFileError):
            load_history(path)
            pytest.fail(f"{name}: loaded")


def test_a_failed_record_is_counted_and_answered_residual() -> None:
    online = OnlineTtl(CONFIG, clock=FakeClock())

    class BrokenRecorder:
        page_accesses = 0

        def __len__(self) -> int:
            return 0

        def record_request(self, *args: object) -> None:
            raise RuntimeError("injected")

    online._recorder = BrokenRecorder()  # type: ignore[assignment]
    assert online.record(["a", "b"]) == [RESIDUAL_GROUP] * 2
    assert online.status()["record_errors"] == 1
