"""Admission of the workers' requests: the fault holds new ones and waits for those in flight."""

from __future__ import annotations

import threading
import time


class TrafficGate:
    """Open: workers may start requests. Every request in flight is counted, admin ones too."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()
        self._inflight = 0

    def wait_open(self, timeout_s: float) -> bool:
        return self._open.wait(timeout=timeout_s)

    def try_enter(self) -> bool:
        """Count a worker's request in flight, unless the gate closed meanwhile."""
        with self._lock:  # `hold` closes the gate under this lock
            if not self._open.is_set():
                return False
            self._inflight += 1
            return True

    def enter(self) -> None:
        """Count a request that passes even while the gate is held (admin, fault probes)."""
        with self._lock:
            self._inflight += 1

    def leave(self) -> None:
        with self._lock:
            self._inflight -= 1

    def hold(self) -> None:
        with self._lock:
            self._open.clear()

    def drain(self, timeout_s: float, stop: threading.Event) -> None:
        """Wait until no request is in flight, at most `timeout_s` or until `stop`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not stop.is_set():
            with self._lock:
                if self._inflight == 0:
                    return
            time.sleep(0.2)

    def resume(self) -> None:
        self._open.set()
