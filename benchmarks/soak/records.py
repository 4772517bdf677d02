"""One record per request: when it started, its kind, HTTP status, status class and latency."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks.soak.gate import TrafficGate

# `client_error`: an exception in this benchmark (a bug here, never blamed on the server, but it
# fails the run so that it gets fixed); `other`: a status outside 2xx/4xx/5xx, or a request error
# of `requests` that is neither a timeout nor a connection error.
STATUS_CLASSES = (
    "2xx",
    "4xx",
    "5xx",
    "other",
    "conn_error",
    "timeout",
    "stream_error",
    "client_error",
    "aborted",
)
FAILURE_CLASSES = ("5xx", "other", "conn_error", "timeout", "stream_error", "client_error")

# What a request gives back: (HTTP status or None when no response came, class, details).
Outcome = tuple[int | None, str, dict[str, Any]]


def status_class(code: int) -> str:
    if 200 <= code < 300:
        return "2xx"
    if 400 <= code < 500:
        return "4xx"
    if 500 <= code < 600:
        return "5xx"
    return "other"


@dataclass(frozen=True)
class Record:
    t: float  # seconds since the start of the traffic, at the request's start
    kind: str
    status: int | None  # HTTP status, None when no response came
    cls: str  # one of STATUS_CLASSES
    latency_s: float
    detail: dict[str, Any] = field(default_factory=dict)


class Recorder:
    """The records of a run, the run's clock, and timing of a request through the gate."""

    def __init__(self, gate: TrafficGate) -> None:
        self.gate = gate
        self.t0 = time.monotonic()
        self._records: list[Record] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        """The traffic starts now: time 0 of the records."""
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def snapshot(self) -> list[Record]:
        with self._lock:
            return list(self._records)

    def timed(self, kind: str, call: Callable[[], Outcome], entered: bool = False) -> Outcome:
        """Run and record one request; `entered`: the caller has already counted it in flight."""
        if not entered:
            self.gate.enter()
        start = time.monotonic()
        t = self.now()
        try:
            status, cls, detail = call()
        except Exception as error:  # a bug of this benchmark must not pass as a server error
            status, cls, detail = None, "client_error", {"client_exception": repr(error)[:300]}
        finally:
            self.gate.leave()
        with self._lock:
            self._records.append(Record(t, kind, status, cls, time.monotonic() - start, detail))
        return status, cls, detail
