"""`free_port`: the port a server binds seconds later is one nothing else takes meanwhile."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sglang_hicache_ext.sglang_ext.server.ports import PORT_RANGE_LOW

PICK_PORTS = """
import sys
from sglang_hicache_ext.sglang_ext.server.ports import free_port
print(*(free_port() for _ in range(int(sys.argv[1]))))
"""


def test_free_ports_stay_out_of_the_kernels_range_and_differ_across_processes() -> None:
    """The port a server binds seconds later must not be one the kernel hands to a `bind(0)`
    meanwhile (every scheduler's gloo listeners; one CI start lost its port that way), nor one
    another process was just given."""
    pickers = [
        subprocess.Popen(
            [sys.executable, "-c", PICK_PORTS, "10"], stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    ports = [int(port) for picker in pickers for port in picker.communicate(timeout=60)[0].split()]
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert len(ports) == len(set(ports)) == 30
    assert all(PORT_RANGE_LOW <= port < ephemeral_low for port in ports)
