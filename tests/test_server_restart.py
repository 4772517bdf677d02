"""A server restarted 1 s after `kill -9` starts on the same port (no false "port in use")."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest
import requests

from sglang_hicache_ext.sglang_ext.server.launcher import ServerConfig, free_port, running_server
from tests.server_processes import TCP_LISTEN, server_process_group, tcp_states_on_port

pytestmark = pytest.mark.server


def test_restart_one_second_after_kill_9(tiny_llama_path: Path, tmp_path: Path) -> None:
    config = ServerConfig(model_path=str(tiny_llama_path), port=free_port(), max_total_tokens=2048)
    with running_server(config, log_path=tmp_path / "first.log"):
        # A keep-alive connection that has served a request, as a live server has.
        session = requests.Session()
        response = session.post(
            config.url + "/generate",
            json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}},
            timeout=120,
        )
        assert response.status_code == 200
        os.killpg(server_process_group(config.port), signal.SIGKILL)
        killed_at = time.monotonic()
        session.close()  # the client answers the dead server's FIN
    leftovers = tcp_states_on_port(config.port)
    assert TCP_LISTEN not in leftovers
    # The old check (a bind without SO_REUSEADDR) would refuse the port now.
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind((config.host, config.port))
    time.sleep(max(0.0, 1.0 - (time.monotonic() - killed_at)))
    restarted_at = time.monotonic()
    with running_server(config, log_path=tmp_path / "second.log", startup_timeout_s=180):
        assert requests.get(config.url + "/health", timeout=10).status_code == 200
        print(
            f"\nrestart {restarted_at - killed_at:.1f} s after kill -9 (sockets left on the port: "
            f"{leftovers}): healthy after {time.monotonic() - restarted_at:.0f} s"
        )
