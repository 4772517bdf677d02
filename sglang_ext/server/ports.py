"""Ports for servers this machine starts: one a server can still bind seconds after it is chosen.

A server binds its port seconds after the port is chosen. `bind(0)` would choose from the
kernel's ephemeral range, where every scheduler's gloo listeners (nine per server) and every
outgoing connection take ports meanwhile: one CI run lost a server start to a listener on its
port. So a port comes from below that range, and is reserved for ten minutes across this
machine's processes (a locked file in the temp folder), so two callers never get the same.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import socket
import tempfile
import time
from pathlib import Path

# Ports `free_port` hands out: above SGLang's own picks for its rendezvous port (22000-29999,
# `get_free_port_below_ephemeral`) and Mooncake's handshake ports (15000-17000), below the
# kernel's ephemeral range, and not SGLang's default port 30000.
PORT_RANGE_LOW = 30001
_RESERVATION_S = 600.0
_RESERVATIONS = Path(tempfile.gettempdir()) / f"sglang-hicache-ext-ports-{os.getuid()}.json"


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing holds now and no other caller gets for ten minutes, below the kernel's
    ephemeral range (the module says why); `bind(0)`'s where that range leaves too few."""
    ephemeral_low = _ephemeral_low()
    if ephemeral_low - PORT_RANGE_LOW < 64:
        return _kernel_port(host)
    try:
        return _reserved_port(host, ephemeral_low)
    except OSError:  # no writable temp folder: unreserved, as before
        return _kernel_port(host)


def _reserved_port(host: str, ephemeral_low: int) -> int:
    with open(_RESERVATIONS.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        now = time.time()
        try:
            reserved = {int(port): at for port, at in json.loads(_RESERVATIONS.read_text()).items()}
        except (OSError, ValueError, AttributeError):
            reserved = {}
        reserved = {port: at for port, at in reserved.items() if now - at < _RESERVATION_S}
        candidates = [p for p in range(PORT_RANGE_LOW, ephemeral_low) if p not in reserved]
        for port in random.sample(candidates, min(64, len(candidates))):
            if _bindable(host, port):
                reserved[port] = now
                _RESERVATIONS.write_text(json.dumps(reserved))
                return port
    return _kernel_port(host)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def _kernel_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
