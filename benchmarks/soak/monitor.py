"""The monitor thread: RSS of the server's process group, and its process and /health."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import requests

from benchmarks.soak.console import say
from benchmarks.soak.server_process import group_rss, log_tail, process_alive


@dataclass
class ServerMonitor:
    """Samples every `sample_s`; an exited server or 3 failed health checks in a row is a crash,
    which sets `stop` (the run ends)."""

    url: str
    log_path: Path
    clock: Callable[[], float]
    stop: threading.Event
    sample_s: float
    rss_samples: list[tuple[float, int, dict[int, int]]] = field(default_factory=list)
    health_failures: list[dict[str, Any]] = field(default_factory=list)
    proc_names: dict[int, str] = field(default_factory=dict)  # pid -> command, for the report
    crash: dict[str, Any] | None = None

    def run(self, server: psutil.Process, finished: Callable[[float], bool]) -> None:
        """Until `stop`, a crash, or `finished(t)` holds after a sample."""
        pgid = os.getpgid(server.pid)
        failures_in_row = 0
        while not self.stop.is_set():
            t = self.clock()
            rss = group_rss(pgid)
            for pid in rss:
                if pid not in self.proc_names:
                    with contextlib.suppress(psutil.Error):
                        self.proc_names[pid] = " ".join(psutil.Process(pid).cmdline()[:3])[:120]
            if not process_alive(server):
                self.declare_crash(t, f"server process {server.pid} exited")
                return
            self.rss_samples.append((t, sum(rss.values()), rss))
            error = self.health_error()
            if error is None:
                failures_in_row = 0
            else:
                failures_in_row += 1
                self.health_failures.append({"t": t, "error": error})
                if failures_in_row >= 3:
                    self.declare_crash(t, f"/health failed 3 times in a row (last: {error})")
                    return
            if finished(t):
                return
            self.stop.wait(self.sample_s)

    def health_error(self) -> str | None:
        try:
            code = requests.get(self.url + "/health", timeout=10).status_code
        except requests.RequestException as err:
            return type(err).__name__
        return None if code == 200 else f"HTTP {code}"

    def declare_crash(self, t: float, reason: str) -> None:
        self.crash = {"t": t, "reason": reason, "log_tail": log_tail(self.log_path)}
        say(f"[{t:7.1f}s] CRASH: {reason}")
        self.stop.set()
