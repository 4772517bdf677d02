"""Start and stop a real `python -m sglang.launch_server` with the extension, as a subprocess.

Used by the demo, the benchmarks and the end-to-end tests. The server runs in its own process
group, so stopping it (or an exception in the caller) leaves no process behind.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import psutil
import requests


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy; the message carries its log tail."""


def default_device() -> str:
    """`cuda` when torch sees a CUDA device, else `cpu`: the launcher follows the machine."""
    import torch  # lazy: the launcher's importers (tests, CLIs) need not pay for torch up front

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Flags for a development server; defaults are the embedded demo setup.

    `device=None` follows the machine (`default_device`). On CPU the launcher adds what SGLang
    needs there (the CPU engine, our `torch_position` attention, fp32, a small static memory
    fraction, `--sleep-on-idle`); on CUDA it leaves SGLang's own defaults (FlashInfer, `auto`
    dtype) unless a field sets them.
    """

    model_path: str
    port: int = 30000
    host: str = "127.0.0.1"
    device: str | None = None
    attention_backend: str | None = None  # CPU: torch_position; CUDA: SGLang's default
    radix_cache_backend: str | None = "hicache_ext"
    # CPU: float32, since SGLang's "auto" turns fp32 checkpoints into slow fp16.
    dtype: str | None = None
    max_total_tokens: int = 16384
    page_size: int = 16
    hierarchical_cache: bool = False
    hicache_storage_backend: str | None = None
    hicache_storage_dir: str | None = None
    extra_args: Sequence[str] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def resolved_device(self) -> str:
        return self.device or default_device()

    def command(self) -> list[str]:
        on_cpu = self.resolved_device == "cpu"
        attention = self.attention_backend or ("torch_position" if on_cpu else None)
        dtype = self.dtype or ("float32" if on_cpu else None)
        cmd = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model_path,
            "--device",
            self.resolved_device,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--skip-server-warmup",
            "--max-total-tokens",
            str(self.max_total_tokens),
            "--page-size",
            str(self.page_size),
        ]
        if dtype:
            cmd += ["--dtype", dtype]
        if attention:
            cmd += ["--attention-backend", attention]
        if on_cpu:
            # An idle scheduler otherwise polls and holds a whole core of the two we have.
            cmd += ["--mem-fraction-static", "0.3", "--sleep-on-idle"]
        if self.radix_cache_backend:
            cmd += ["--radix-cache-backend", self.radix_cache_backend]
        if self.hierarchical_cache:
            cmd += [
                "--enable-hierarchical-cache",
                "--hicache-io-backend",
                "direct",
                "--hicache-mem-layout",
                "layer_first",
            ]
            if self.hicache_storage_backend:
                cmd += ["--hicache-storage-backend", self.hicache_storage_backend]
        return [*cmd, *self.extra_args]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        if self.resolved_device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
        if self.hicache_storage_dir:
            # HiCacheFile reads its folder from this variable.
            env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = self.hicache_storage_dir
        env.update(self.env)
        return env

    def with_settings(self, path: Path, values: Mapping[str, Any]) -> ServerConfig:
        """This config with the extension's settings `values`: written as JSON to `path`, which
        `SGLANG_HICACHE_EXT_CONFIG` names to the server."""
        # Lazy: the settings model costs ~0.5 s to import, which the launcher's other users
        # (the demo, every benchmark and test process) need not pay.
        from sglang_hicache_ext.sglang_ext.config.settings_sources import CONFIG_ENV_VAR

        path.write_text(json.dumps(values))
        return dataclasses.replace(self, env={**self.env, CONFIG_ENV_VAR: str(path)})

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def _tail(path: Path, lines: int = 40) -> str:
    """The log's last `lines` lines, and before them its first traceback when the tail does not
    hold it: a process that fails in one rank or thread often logs pages of shutdown after the
    cause (a start that failed under load once showed only those)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    tail = text[-lines:]
    first = next((i for i, line in enumerate(text) if line.startswith("Traceback")), None)
    if first is None or first >= len(text) - lines:
        return "\n".join(tail)
    end = next(
        (i + 1 for i in range(first + 1, len(text)) if text[i] and not text[i][0].isspace()),
        len(text),
    )
    cause = text[first : min(end, first + lines)]
    return "\n".join([*cause, f"... ({len(text) - lines - first - len(cause)} lines) ...", *tail])


class ServerProcess(Protocol):
    """The part of `subprocess.Popen` the launcher uses (the server leads its process group)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def stop_process_group(process: ServerProcess, grace_s: float = 15.0) -> None:
    """SIGTERM to the server's whole process group; SIGKILL what is left after `grace_s`.

    SGLang's launcher, seeing its scheduler stopped by the same signal, sleeps 5 s "to let GPU
    activity settle" before crash diagnostics of processes that are gone: once the launcher is
    the last process of its group it has nothing left to stop, and is killed."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while process.poll() is None and time.monotonic() < deadline:
            if not _others_in_group(process.pid):
                os.killpg(process.pid, signal.SIGKILL)
                break
            time.sleep(0.1)
        else:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=grace_s)
    except ProcessLookupError:
        pass


def _others_in_group(pgid: int) -> bool:
    """Whether a live process other than the leader (and multiprocessing's resource tracker,
    which leaves with it) is in the group."""
    for other in psutil.process_iter(["pid", "status", "cmdline"]):
        try:
            if other.pid == pgid or os.getpgid(other.pid) != pgid:
                continue
        except (ProcessLookupError, PermissionError):
            continue
        if other.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if "resource_tracker" in " ".join(other.info["cmdline"] or ()):
            continue
        return True
    return False


@contextmanager
def running_server(
    config: ServerConfig,
    log_path: Path,
    startup_timeout_s: float = 300.0,
    started: ServerProcess | None = None,
) -> Iterator[ServerConfig]:
    """Start the server, wait until `/health` answers, yield, then stop the whole process group.
    `started`: the process `start_server` started for this config earlier, waited for instead.

    SIGTERM to the caller also stops the server: Python's default SIGTERM skips `finally`."""
    with running_servers(
        [(config, log_path)], startup_timeout_s, started=None if started is None else [started]
    ) as (running,):
        yield running


@contextmanager
def running_servers(
    servers: Sequence[tuple[ServerConfig, Path]],
    startup_timeout_s: float = 300.0,
    started: Sequence[ServerProcess] | None = None,
) -> Iterator[list[ServerConfig]]:
    """`running_server` for several servers (config, log path) started at once: a start is
    mostly Python imports, one core per process at first, so on a small machine starts that
    overlap finish sooner than one after another. Yields the configs once every server is
    healthy; stops them all on exit, or when one fails to start."""
    previous_handler = exit_on_sigterm()
    processes: list[ServerProcess] = list(started or ())
    try:
        for config, log_path in servers[len(processes) :]:
            processes.append(start_server(config, log_path))
        deadline = time.monotonic() + startup_timeout_s
        for process, (config, log_path) in zip(processes, servers, strict=True):
            _wait_until_healthy(process, config, log_path, deadline, startup_timeout_s)
        yield [config for config, _ in servers]
    finally:
        for process in processes:
            stop_process_group(process)
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)


def start_subprocess(config: ServerConfig, log_path: Path) -> ServerProcess:
    """`python -m sglang.launch_server ...` in its own session, output to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            config.command(),
            env=config.environment(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


ServerStarter = Callable[[ServerConfig, Path], ServerProcess]
_starter: ServerStarter = start_subprocess


@contextmanager
def server_starter(starter: ServerStarter) -> Iterator[None]:
    """Start the servers of `running_servers` with `starter` inside the block (the test session
    forks them from a process that imported SGLang once: tests/server_zygote.py)."""
    global _starter
    previous, _starter = _starter, starter
    try:
        yield
    finally:
        _starter = previous


def start_server(config: ServerConfig, log_path: Path) -> ServerProcess:
    """Start one server the current way (`server_starter`) without waiting for it."""
    return _starter(config, log_path)


def wait_until_healthy(
    process: ServerProcess, config: ServerConfig, log_path: Path, deadline: float
) -> None:
    """Until the server answers `/health` (monotonic `deadline`); ServerStartError with its log
    tail if it exits or the deadline passes."""
    _wait_until_healthy(process, config, log_path, deadline, deadline - time.monotonic())


def _wait_until_healthy(
    process: ServerProcess,
    config: ServerConfig,
    log_path: Path,
    deadline: float,
    startup_timeout_s: float,
) -> None:
    while True:
        if process.poll() is not None:
            raise ServerStartError(
                f"server exited with status {process.returncode} during startup; log {log_path}:\n{_tail(log_path)}"
            )
        try:
            if requests.get(config.url + "/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise ServerStartError(
                f"server not healthy after {startup_timeout_s:.0f}s; log {log_path}:\n{_tail(log_path)}"
            )
        time.sleep(0.25)  # a refused connection costs nothing; a forked test server starts in ~4 s


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> Any:
    """Turn SIGTERM into SystemExit (main thread only); returns the handler to restore, None
    where it left the handler alone. `running_servers` holds it while its servers run; a caller
    that stops servers in another order than it started them (a test session) holds it
    throughout."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None  # the caller handles SIGTERM itself
    return signal.signal(signal.SIGTERM, _raise_system_exit)


def generate(
    url: str, text: str, max_new_tokens: int = 8, timeout_s: float = 1200.0, **extra: Any
) -> dict[str, Any]:
    """Greedy `/generate` request; returns the response JSON (raises on an HTTP error)."""
    response = requests.post(
        url + "/generate",
        json={
            "text": text,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
            **extra,
        },
        timeout=timeout_s,
    )
    response.raise_for_status()
    return response.json()


def flush_cache(url: str, attempts: int = 30) -> None:
    """`/flush_cache`, retried: SGLang refuses it while requests are still running."""
    for _ in range(attempts):
        if requests.post(url + "/flush_cache", timeout=60).status_code == 200:
            return
        time.sleep(1.0)
    raise RuntimeError(f"{url}/flush_cache refused {attempts} times (requests still running?)")


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
