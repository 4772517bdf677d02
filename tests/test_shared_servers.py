"""A session's shared server stops right after the last selected test that uses it, and its
fixture's own teardown at the session's end is then a no-op (stand-in servers, no SGLang)."""

from __future__ import annotations

import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.shared_servers import SharedServers
from tests.test_launcher import _listening, _stand_in

pytestmark = pytest.mark.usefixtures("spawned_servers")  # stand-ins: subprocesses, not forks


def _item(nodeid: str, *fixtures: str) -> SimpleNamespace:
    return SimpleNamespace(nodeid=nodeid, fixturenames=("tmp_path", *fixtures))


def test_a_shared_server_stops_after_its_last_user(tmp_path: Path) -> None:
    first, other, last = _item("t::a", "srv"), _item("t::b"), _item("t::c", "srv")
    shared = SharedServers()
    shared.plan([first, other, last])  # type: ignore[list-item]
    config, log = _stand_in(tmp_path, "srv", 0.0)
    with shared.serve("srv", config, log) as running:
        for item in (first, other):
            shared.release_after(item)  # type: ignore[arg-type]
            assert _listening(running.port)
        shared.release_after(last)  # type: ignore[arg-type]
        assert not _listening(running.port)
    assert not _listening(running.port)


def test_an_unplanned_server_lives_to_the_end(tmp_path: Path) -> None:
    shared = SharedServers()
    shared.plan([_item("t::a")])  # type: ignore[list-item]
    config, log = _stand_in(tmp_path, "srv", 0.0)
    with shared.serve("srv", config, log) as running:
        shared.release_after(_item("t::a"))  # type: ignore[arg-type]
        assert _listening(running.port)
    assert not _listening(running.port)


def test_the_session_holds_sigterm_as_system_exit() -> None:
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as a plain pytest starts
    try:
        shared = SharedServers()
        shared.start_session()
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        shared.end_session()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)
