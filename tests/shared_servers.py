"""Servers that several test files share, one per session, each stopped after the last selected
test that uses it.

pytest keeps a session fixture until the session ends. An idle server sleeps (no CPU) but keeps
its memory (a SmolLM2 server with a 20K-token pool and a host tier holds several GB), and the
tests after its last user start servers of their own; so `tests/conftest.py` serves each shared
server through `SharedServers.serve` and calls `release_after` when a test has run.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from sglang_hicache_ext.sglang_ext.server.launcher import (
    ServerConfig,
    ServerProcess,
    exit_on_sigterm,
    running_server,
    start_server,
    stop_process_group,
)


class SharedServers:
    def __init__(self) -> None:
        self._last_user: dict[str, str] = {}  # fixture name -> node id of its last selected test
        self._running: dict[str, contextlib.ExitStack] = {}
        self._previous_sigterm: Any = None
        self._started_early: dict[str, ServerProcess] = {}

    def start_session(self) -> None:
        # Shared servers stop in another order than they started: hold SIGTERM -> SystemExit
        # for the whole session, so that it stops every server whichever is still running.
        self._previous_sigterm = exit_on_sigterm()

    def end_session(self) -> None:
        for process in self._started_early.values():  # started for tests that did not run
            stop_process_group(process)
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)

    def plan(self, items: Sequence[pytest.Item]) -> None:
        """Note the last selected test of each fixture (the order the tests will run in)."""
        for item in items:
            for name in getattr(item, "fixturenames", ()):
                self._last_user[name] = item.nodeid

    def planned(self, name: str) -> bool:
        """Whether a selected test uses the fixture `name`."""
        return name in self._last_user

    def start_early(self, name: str, config: ServerConfig, log_path: Path) -> None:
        """Start `name`'s server now, without waiting: its fixture's `serve` (same config and
        log) waits for it then. For a server whose start is mostly imports, which the other
        core does while earlier tests run."""
        self._started_early[name] = start_server(config, log_path)

    @contextlib.contextmanager
    def serve(self, name: str, config: ServerConfig, log_path: Path) -> Iterator[ServerConfig]:
        """`running_server` for the session fixture `name`; `release_after` may stop it early."""
        with contextlib.ExitStack() as stack:
            started = self._started_early.pop(name, None)
            running = stack.enter_context(
                running_server(config, log_path=log_path, started=started)
            )
            self._running[name] = stack
            try:
                yield running
            finally:
                self._running.pop(name, None)

    def release_after(self, item: pytest.Item) -> None:
        """Stop the shared servers whose last selected test `item` was."""
        for name in [n for n in self._running if self._last_user.get(n) == item.nodeid]:
            self._running.pop(name).close()
