"""Test servers forked from one process that has imported SGLang already.

A server start on this 2-core machine is mostly imports: `python -m sglang.launch_server`
imports SGLang (~10 s), then SGLang spawns its scheduler and detokenizer, which import it again
(~10 s more, both at once). The test session starts one zygote process that imports the server
once; each test server is a fork of it that runs what `python -m sglang.launch_server` runs,
with the server's own environment, log file and process session, and whose scheduler and
detokenizer are forked too (SGLang asks for spawn; the fork gives them the same modules).

What the forks skip is the import, not the server: the same `launch_server` code, flags,
plugin entry points and hooks run in every process (the scheduler and detokenizer inherit the
hooks that `load_plugins` applied in their parent, which is what loading them again would do).
The plain `python -m sglang.launch_server` path stays tested: `tests/test_launcher.py`
(`spawned_servers`), the session's `tiny_qwen2_server` and two of the refused launches of
`tests/test_preflight.py` start real subprocesses.

    python -m tests.server_zygote SOCKET   # serves forks until the connection closes
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

from sglang_hicache_ext.sglang_ext.config.settings_sources import CONFIG_ENV_VAR, EXTRA_CONFIG_KEY
from sglang_hicache_ext.sglang_ext.server.launcher import ServerConfig

# What `python -m sglang.launch_server` and SGLang's children import before serving.
PRELOAD = (
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.models.registry",
    "sglang_hicache_ext.sglang_ext.plugin",
)


# A shadow check is one more normal prefill of a fused prompt, run whenever the server has been
# idle for half a second: on 2 cores, a test server that checks a quarter of the fused answers
# (the shipped default) doubles some tests' time. Forked test servers check none unless their
# test asks: a settings file that names `fusion_shadow_rate`, or `custom_params.fusion_shadow`
# per request (tests/test_server_shadow_checks.py, tests/test_server_concurrency.py).
QUIET_SHADOW = {"fusion_shadow_rate": 0.0}


def without_shadow_checks(
    env: dict[str, str], command: Sequence[str], folder: Path
) -> dict[str, str]:
    """`env` with the server's settings set to check no answer, unless they say otherwise.
    Settings given inline in the extra-config, or a file that does not parse, stay as given."""
    named = env.get(CONFIG_ENV_VAR)
    if named is None:
        if any(EXTRA_CONFIG_KEY in arg for arg in command):
            return env
        quiet = folder / "quiet-shadow-checks.json"
        quiet.write_text(json.dumps(QUIET_SHADOW))
        return {**env, CONFIG_ENV_VAR: str(quiet)}
    path = Path(named)
    try:
        values = json.loads(path.read_text()) if path.suffix == ".json" else None
    except (OSError, ValueError):
        return env  # the server's own check refuses it, as it would without this
    if not isinstance(values, dict) or "fusion_shadow_rate" in values:
        return env
    quiet = path.with_name(f"{path.stem}.quiet-shadow-checks.json")
    quiet.write_text(json.dumps({**values, **QUIET_SHADOW}))
    return {**env, CONFIG_ENV_VAR: str(quiet)}


class ForkedServer:
    """A server forked by the zygote, with the part of `subprocess.Popen` the launcher uses."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self._zygote, self.pid = zygote, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.returncode(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"server {self.pid}", timeout or 0.0)
            time.sleep(0.1)
        assert self.returncode is not None
        return self.returncode


class Zygote:
    """The test session's side: starts the zygote, asks it for forks."""

    def __init__(self, socket_dir: Path) -> None:
        address = str(socket_dir / "zygote.sock")
        with open(socket_dir / "zygote.log", "wb") as log:  # SGLang's import-time warnings
            self._process = subprocess.Popen(
                [sys.executable, "-m", "tests.server_zygote", address],
                cwd=Path(__file__).resolve().parent.parent,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        # Its import of SGLang takes ~20 s alone; `make test` starts the tests while the models
        # are still prepared beside them, and under that load it once took over 120 s.
        deadline = time.monotonic() + 300
        while not os.path.exists(address):
            if self._process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server zygote did not start (status {self._process.poll()})")
            time.sleep(0.05)
        self._connection: Connection = Client(address, family="AF_UNIX")
        self._lock = threading.Lock()  # one question and its answer at a time on the connection

    def start(self, config: ServerConfig, log_path: Path) -> ForkedServer:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        command = config.command()
        assert command[1:3] == ["-m", "sglang.launch_server"], command
        env = without_shadow_checks(config.environment(), command, log_path.parent)
        pid = self._ask(("start", command[3:], env, str(log_path)))
        return ForkedServer(self, pid)

    def returncode(self, pid: int) -> int | None:
        return self._ask(("status", pid))

    def _ask(self, message: tuple[Any, ...]) -> Any:
        with self._lock:
            self._connection.send(message)
            reply = self._connection.recv()
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._connection.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout=10)
        if self._process.poll() is None:
            self._process.kill()


def _serve(address: str) -> None:
    for module in PRELOAD:
        __import__(module)
    with Listener(address, family="AF_UNIX") as listener, listener.accept() as connection:
        exited: dict[int, int] = {}
        while True:
            try:
                message = connection.recv()
            except EOFError:
                return
            _reap(exited)
            if message[0] == "start":
                connection.send(_fork_server(connection, *message[1:]))
            elif message[0] == "status":
                connection.send(exited.get(message[1]))
            else:
                connection.send(ValueError(f"unknown zygote request {message!r}"))


def _reap(exited: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        exited[pid] = os.waitstatus_to_exitcode(status)


def _fork_server(connection: Connection, args: Sequence[str], env: dict[str, str], log: str) -> int:
    pid = os.fork()
    if pid:
        return pid
    try:  # the server: never returns into the zygote's loop
        connection.close()
        os.setsid()
        log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null_fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.environ.clear()
        os.environ.update(env)
        _replay_external_models(env)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _launch(list(args))
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _replay_external_models(env: dict[str, str]) -> None:
    """SGLang registers `SGLANG_EXTERNAL_MODEL_PACKAGE`'s classes when its model registry is
    imported, which the zygote did before this server's environment existed: what that import
    does, done again (the package imported from the server's PYTHONPATH)."""
    package = env.get("SGLANG_EXTERNAL_MODEL_PACKAGE")
    if not package:
        return
    from sglang.srt.models.registry import ModelRegistry, import_model_classes

    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    ModelRegistry.models.update(import_model_classes(package, strict=True))


def _launch(args: list[str]) -> None:
    """`python -m sglang.launch_server ARGS`: the module run as `__main__` (so the extension
    sees a command-line launch: one-line errors, the port check, its timers), with SGLang's
    children forked."""
    set_start_method = multiprocessing.set_start_method

    def fork_instead(method: str | None, force: bool = False) -> None:
        set_start_method("fork", force=True)

    multiprocessing.set_start_method = fork_instead  # type: ignore[assignment]
    sys.argv = ["sglang.launch_server", *args]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


@contextlib.contextmanager
def zygote(socket_dir: Path) -> Iterator[Zygote]:
    started = Zygote(socket_dir)
    try:
        yield started
    finally:
        started.close()


if __name__ == "__main__":
    _serve(sys.argv[1])
