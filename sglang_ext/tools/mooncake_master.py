"""A real Mooncake master on loopback for the shared chunk tier's tests and benchmarks (started,
killed mid-test), optionally with a separate process lending the store its memory.

The master serves the store's RPC only: clients use P2PHANDSHAKE metadata. With
`segment_bytes`, a `mooncake_client` process lends that much memory, so that servers lending
none (`chunk_mooncake_segment_bytes = 0`) read every chunk from another process over TCP, as
they would from a store on another machine.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sglang_hicache_ext.sglang_ext.server.ports import free_port

_DEPS = Path(sys.prefix) / "lib" / "mooncake-deps"  # devenv/mooncake_deps.sh


class MooncakeMaster:
    def __init__(self, log_path: Path, segment_bytes: int = 0) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.segment_bytes = segment_bytes
        self._log_path = log_path
        self._processes: list[subprocess.Popen[bytes]] = []
        self.commands: list[list[str]] = []  # as started (the local cluster prints them)

    def start(self, timeout_s: float = 30.0) -> None:
        binaries = Path(sys.executable).parent
        self._spawn(
            binaries / "mooncake_master",
            "--rpc_address=127.0.0.1",
            f"--port={self.port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={free_port()}",
            "--enable_metric_reporting=false",
        )
        self._wait_listening(self.port, timeout_s)
        if self.segment_bytes:
            lender = free_port()
            self._spawn(
                binaries / "mooncake_client",
                f"--global_segment_size={self.segment_bytes // 2**20}MB",
                f"--master_server_address={self.address}",
                "--metadata_server=P2PHANDSHAKE",
                "--host=127.0.0.1",
                f"--port={lender}",
                "--protocol=tcp",
            )
            self._wait_listening(lender, timeout_s)

    def kill(self) -> None:
        """SIGKILL, as a crash (clients see the master gone at once)."""
        for process in self._processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
        self._processes = []

    def _spawn(self, binary: Path, *flags: str) -> None:
        env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
        if _DEPS.is_dir():  # no system libibverbs: the extracted copy
            env["LD_LIBRARY_PATH"] = ":".join(
                filter(None, [str(_DEPS), env.get("LD_LIBRARY_PATH")])
            )
        self.commands.append([binary.name, *flags])
        with open(self._log_path, "ab") as log:
            self._processes.append(
                subprocess.Popen(
                    [str(binary), *flags],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            )

    def _wait_listening(self, port: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self._processes):
                self.kill()
                raise RuntimeError(f"Mooncake exited: {self._log_path.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"Mooncake not listening on port {port} after {timeout_s} s")


@contextmanager
def running_master(log_path: Path, segment_bytes: int = 0) -> Iterator[MooncakeMaster]:
    master = MooncakeMaster(log_path, segment_bytes)
    master.start()
    try:
        yield master
    finally:
        master.kill()
