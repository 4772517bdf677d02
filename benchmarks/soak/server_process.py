"""The server seen from outside: its process, its process group's RSS, its log."""

from __future__ import annotations

import contextlib
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

_LOG_ERROR = re.compile(r"Traceback|Error|ERROR|Exception|exception|CRITICAL")
_LOG_NUMBERS = re.compile(r"0x[0-9a-f]+|\b[0-9a-f]{12,}\b|\d+(\.\d+)?")


def find_server_process(port: int) -> psutil.Process:
    """Our child `sglang.launch_server` on `port` (the launcher keeps the Popen to itself)."""
    for child in psutil.Process().children(recursive=False):
        with contextlib.suppress(psutil.Error):
            cmd = child.cmdline()
            if "sglang.launch_server" in cmd and str(port) in cmd:
                return child
    raise RuntimeError(f"no sglang.launch_server child process on port {port}")


def group_rss(pgid: int) -> dict[int, int]:
    """RSS in bytes of every live process in the process group `pgid`."""
    rss: dict[int, int] = {}
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) != pgid or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            rss[proc.pid] = proc.memory_info().rss
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return rss


def process_alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def log_tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def scan_log(path: Path, limit: int = 40) -> dict[str, Any]:
    """Lines of the server log that look like errors, grouped by their shape (numbers masked)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {"lines": 0, "matching": 0, "patterns": []}
    counts: Counter[str] = Counter()
    example: dict[str, str] = {}
    lines = text.splitlines()
    for line in lines:
        if not _LOG_ERROR.search(line) or "UserWarning" in line or "warnings.warn" in line:
            continue
        shape = _LOG_NUMBERS.sub("#", line.split("] ", 1)[-1])[:200]
        counts[shape] += 1
        example.setdefault(shape, line[:400])
    return {
        "lines": len(lines),
        "matching": sum(counts.values()),
        "patterns": [
            {"count": n, "example": example[shape]} for shape, n in counts.most_common(limit)
        ],
    }
