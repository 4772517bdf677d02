"""`running_servers` starts several servers at once, yields once all are healthy and stops all of
them, also when one fails to start. Stand-in servers (a few lines of `http.server`) keep this
fast; the real SGLang servers go through the same code in the `server` tests."""

from __future__ import annotations

import dataclasses
import socket
import sys
from pathlib import Path

import pytest

from sglang_hicache_ext.sglang_ext.server.launcher import (
    ServerConfig,
    ServerStartError,
    running_servers,
)
from sglang_hicache_ext.sglang_ext.server.ports import free_port

# Stand-ins are not SGLang: started as subprocesses, not forked from the test zygote.
pytestmark = pytest.mark.usefixtures("spawned_servers")

# argv: port, seconds before it listens (negative: exit with status 3 instead), stamp file.
STAND_IN = """
import http.server, pathlib, sys, time
port, delay_s, stamp = int(sys.argv[1]), float(sys.argv[2]), pathlib.Path(sys.argv[3])
stamp.write_text(repr(time.time()))
if delay_s < 0:  # a cause, then pages of shutdown noise
    print("Traceback (most recent call last):")
    print("  File 'x.py', line 1")
    print("ValueError: the cause")
    for i in range(100):
        print(f"shutting down part {i}", flush=True)
    sys.exit(3)
time.sleep(delay_s)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

stamp.with_suffix(".ready").write_text(repr(time.time()))
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


@dataclasses.dataclass(frozen=True)
class StandIn(ServerConfig):
    delay_s: float = 0.0
    stamp: str = ""

    def command(self) -> list[str]:
        return [sys.executable, "-c", STAND_IN, str(self.port), str(self.delay_s), self.stamp]


def _stand_in(tmp_path: Path, name: str, delay_s: float) -> tuple[StandIn, Path]:
    stamp = str(tmp_path / f"{name}.started")
    config = StandIn(model_path=name, port=free_port(), device="cpu", delay_s=delay_s, stamp=stamp)
    return config, tmp_path / f"{name}.log"


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _stamp(path: Path) -> float:
    return float(path.read_text())


def test_servers_start_together_and_all_stop(tmp_path: Path) -> None:
    servers = [_stand_in(tmp_path, name, delay_s=2.0) for name in ("a", "b")]
    with running_servers(servers) as started:
        assert [c.port for c in started] == [c.port for c, _ in servers]
        assert all(_listening(c.port) for c in started)
    assert not any(_listening(c.port) for c, _ in servers)
    # b was started before a was ready: the starts overlapped, not one after the other
    assert _stamp(tmp_path / "b.started") < _stamp(tmp_path / "a.ready")


def test_a_failed_start_stops_the_servers_already_started(tmp_path: Path) -> None:
    healthy, failing = _stand_in(tmp_path, "a", 0.0), _stand_in(tmp_path, "b", -1.0)
    with (
        pytest.raises(ServerStartError, match="exited with status 3") as raised,
        running_servers([healthy, failing]),
    ):
        pytest.fail("yielded although a server did not start")
    assert (tmp_path / "a.ready").exists()  # a did come up, and was stopped again
    # The cause, logged before the last 40 lines, is in the message beside them.
    assert "ValueError: the cause" in str(raised.value)
    assert "shutting down part 99" in str(raised.value)
    assert not _listening(healthy[0].port)
