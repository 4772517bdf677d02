"""The TCP states of a running test server's sockets (its process group and memory are the
launcher's: `sglang_ext/server/launcher.py`)."""

from __future__ import annotations

# /proc/net/tcp state codes
TCP_LISTEN = "0A"
TCP_TIME_WAIT = "06"


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
