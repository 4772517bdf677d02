"""The processes of a running test server: its process group, their memory, TCP states."""

from __future__ import annotations

import os

import psutil

# /proc/net/tcp state codes
TCP_LISTEN = "0A"
TCP_TIME_WAIT = "06"


def server_process_group(port: int) -> int:
    """The process group of the server listening on `port` (the launcher starts each server in
    its own session, so the group is the whole server: HTTP process, scheduler, detokenizer)."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return os.getpgid(conn.pid)
    raise LookupError(f"no process listens on port {port}")


def group_rss_bytes(pgid: int) -> int:
    """Resident memory summed over the live processes of a process group."""
    total = 0
    for process in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(process.pid) == pgid:
                total += process.memory_info().rss
        except (psutil.Error, ProcessLookupError):
            continue
    return total


def tcp_states_on_port(port: int) -> list[str]:
    """States (/proc/net/tcp codes) of the IPv4 sockets whose local port is `port`."""
    states = []
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                states.append(fields[3])
    return states
