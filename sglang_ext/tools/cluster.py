"""`hicache-ext-cluster`: a local fleet in one command, behind SGLang's own router.

    hicache-ext-cluster --servers 2 --model PATH [--port 30000] [-- <sglang server flags>]

Starts, in this order: a Mooncake master, a store process that lends the shared chunk tier its
memory (so chunks outlive every server: a server lends none), N SGLang servers with the
extension and that tier (each pinned to its share of the cores, announcing the chunks it
stores and indexing the others': `tiers/chunks/remote_catalog.py`), and `smg` (SGLang Model
Gateway) in front. Prints one line per component, waits until every one answers, then keeps
them running: a server that exits (a crash, SIGKILL) is logged and started again on its port,
and the router sends to it again once its health checks pass. SIGINT or SIGTERM stops them
all, leaving nothing running; so does a component that cannot start (one line, exit status 1).

Why these router flags: the cache-aware policy keeps a prompt's *prefix* on one worker (its
tree is built on the request text from the start) and cannot keep a document that sits
anywhere in the prompt; that is what the shared tier does. Health checks every second, with
two failures to mark a worker down, so a killed worker stops getting requests within seconds
(smg's defaults, 60 s x 3, are for fleets where a restart takes minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import psutil
import requests
from pydantic import ValidationError

from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings
from sglang_hicache_ext.sglang_ext.config.settings_sources import CONFIG_ENV_VAR
from sglang_hicache_ext.sglang_ext.config.validation_messages import one_line
from sglang_hicache_ext.sglang_ext.server.launcher import (
    ServerConfig,
    ServerProcess,
    ServerStartError,
    exit_on_sigterm,
    start_server,
    stop_process_group,
    wait_until_healthy,
)
from sglang_hicache_ext.sglang_ext.server.ports import free_port
from sglang_hicache_ext.sglang_ext.server.preflight import PreflightError, check_port_free
from sglang_hicache_ext.sglang_ext.tools.mooncake_master import MooncakeMaster

logger = logging.getLogger(__name__)

ROUTER_FLAGS = (
    "--health-check-interval-secs", "1",
    "--health-failure-threshold", "2",
    "--health-success-threshold", "1",
)  # fmt: skip


RETRY_S = 30.0  # least time between two restarts of one server


class ClusterError(RuntimeError):
    """A component could not start (the message is the one line to print)."""


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    model_path: str
    servers: int = 2
    port: int = 30000  # the router's
    host: str = "127.0.0.1"
    policy: str = "cache_aware"
    store_bytes: int = 1 << 30  # memory the store process lends the shared tier
    settings: dict[str, object] = dataclasses.field(default_factory=dict)
    server_args: tuple[str, ...] = ()
    max_total_tokens: int = 16384
    log_dir: Path | None = None
    shared_tier: bool = True  # False: per-server chunk tiers (the comparison without sharing)
    smg: str | None = None  # the router's binary; None: `smg` on PATH or beside this Python
    startup_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.servers < 1:
            raise ClusterError(f"--servers must be at least 1 (got {self.servers})")
        if not Path(self.model_path).exists():
            raise ClusterError(f"--model {self.model_path}: no such folder")


def core_shares(servers: int, cores: Sequence[int]) -> list[tuple[int, ...]]:
    """The cores each server is pinned to: an even split, or all cores shared round-robin when
    there are more servers than cores."""
    cores = sorted(cores)
    if servers >= len(cores):
        return [(cores[i % len(cores)],) for i in range(servers)]
    per = len(cores) // servers
    return [tuple(cores[i * per : (i + 1) * per]) for i in range(servers)]


class LocalCluster:
    """The components of `hicache-ext-cluster`, started and stopped as one."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.log_dir = spec.log_dir or Path(tempfile.mkdtemp(prefix="hicache-ext-cluster-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.master: MooncakeMaster | None = None
        self.configs: list[ServerConfig] = []
        self.processes: list[ServerProcess] = []
        self.router: subprocess.Popen[bytes] | None = None
        self.restarts = [0] * spec.servers
        self.cores: dict[int, tuple[int, ...]] = {}  # server -> the cores it is pinned to
        self.router_command: list[str] = []

    @property
    def model_name(self) -> str:
        """The model's name on the OpenAI API (its folder's name, unless the flags set one)."""
        args = self.spec.server_args
        if "--served-model-name" in args:
            return args[args.index("--served-model-name") + 1]
        return Path(self.spec.model_path.rstrip("/")).name

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.port}"

    def start(self) -> None:
        """Start every component and wait until each answers; on any failure stop what started
        and raise ClusterError."""
        try:  # the check SGLang's own launch runs (TIME-WAIT sockets are no conflict)
            check_port_free(self.spec.host, self.spec.port)
        except PreflightError as error:
            raise ClusterError(f"router {error}") from None
        smg = self.spec.smg or shutil.which("smg") or str(Path(sys.executable).parent / "smg")
        if not Path(smg).is_file():
            raise ClusterError(
                f"{smg}: no smg (SGLang Model Gateway) there: pip install "
                '"sglang-hicache-ext[cluster]" (smg==1.13.0)'
            )
        try:
            self._start(smg)
        except BaseException:
            self.stop()
            raise

    def _start(self, smg: str) -> None:
        settings = dict(self.spec.settings)
        if self.spec.shared_tier:
            self.master = MooncakeMaster(self.log_dir / "mooncake.log", self.spec.store_bytes)
            try:
                self.master.start()
            except RuntimeError as error:
                raise ClusterError(f"mooncake: {error}") from None
            settings.update(
                chunk_mooncake_master=self.master.address, chunk_mooncake_segment_bytes=0
            )
        settings_file = self.log_dir / "settings.json"
        settings_file.write_text(json.dumps(settings))
        shares = core_shares(self.spec.servers, sorted(os.sched_getaffinity(0)))
        server_args = self.spec.server_args
        if "--served-model-name" not in server_args:  # what clients name through the router
            server_args = (*server_args, "--served-model-name", self.model_name)
        for i, cores in enumerate(shares):
            env = {CONFIG_ENV_VAR: str(settings_file), "OMP_NUM_THREADS": str(len(cores))}
            config = ServerConfig(
                model_path=self.spec.model_path,
                port=free_port(self.spec.host),
                host=self.spec.host,
                max_total_tokens=self.spec.max_total_tokens,
                extra_args=server_args,
                env=env,
            )
            self.configs.append(config)
            self.processes.append(self._start_server(i, cores))
        deadline = time.monotonic() + self.spec.startup_timeout_s
        for i, process in enumerate(self.processes):
            try:
                wait_until_healthy(process, self.configs[i], self._log(i), deadline)
            except ServerStartError as error:
                raise ClusterError(f"server {i}: {str(error).splitlines()[0]}") from None
        self.router = self._start_router(smg)
        self._wait_router(deadline)
        self._write_commands(settings)

    def _write_commands(self, settings: dict[str, object]) -> None:
        """`commands.sh` in the log folder: each component's command, as run here (the
        multi-host deployment of docs/cluster.md runs the same ones on several hosts)."""
        lines = ["# hicache-ext-cluster: the components, in the order started"]
        if self.master is not None:
            lines += [shlex.join(command) for command in self.master.commands]
        lines.append(f"# every server: {CONFIG_ENV_VAR}=settings.json with {json.dumps(settings)}")
        for i, config in enumerate(self.configs):
            cores = ",".join(map(str, self.cores[i]))
            argv = ["taskset", "-c", cores, "python", *config.command()[1:]]
            lines.append(f"OMP_NUM_THREADS={len(self.cores[i])} " + shlex.join(argv))
        lines.append(shlex.join(["smg", *self.router_command[1:]]))
        (self.log_dir / "commands.sh").write_text("\n".join(lines) + "\n")

    def _start_server(self, i: int, cores: tuple[int, ...]) -> ServerProcess:
        process = start_server(self.configs[i], self._log(i))
        # Pinned before SGLang spawns its scheduler, which inherits the mask.
        with contextlib.suppress(psutil.Error):  # exited already: the health wait says why
            psutil.Process(process.pid).cpu_affinity(list(cores))
        self.cores[i] = cores
        return process

    def _start_router(self, smg: str) -> subprocess.Popen[bytes]:
        self.router_command = command = [
            smg, "launch", "--host", self.spec.host, "--port", str(self.spec.port),
            "--policy", self.spec.policy, "--worker-urls", *[c.url for c in self.configs],
            *ROUTER_FLAGS,
        ]  # fmt: skip
        with open(self.log_dir / "router.log", "ab") as log:
            return subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def _wait_router(self, deadline: float) -> None:
        """Until the router answers and routes a request to a worker."""
        assert self.router is not None
        while True:
            if self.router.poll() is not None:
                tail = (self.log_dir / "router.log").read_text(errors="replace")[-400:]
                raise ClusterError(f"router exited ({self.router.returncode}): {tail.strip()}")
            try:
                if requests.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise ClusterError(f"router {self.url} not answering after the startup timeout")
            time.sleep(0.25)

    def kill_server(self, i: int) -> None:
        """SIGKILL server `i`'s whole process group, as a crash."""
        process = self.processes[i]
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)

    def restart_server(self, i: int, wait: bool = True) -> None:
        """Start server `i` again on its port (after it exited)."""
        _stop_group(self.processes[i])
        self.restarts[i] += 1
        self.processes[i] = self._start_server(i, self.cores[i])
        if wait:
            deadline = time.monotonic() + self.spec.startup_timeout_s
            wait_until_healthy(self.processes[i], self.configs[i], self._log(i), deadline)

    def exited(self) -> list[int]:
        return [i for i, p in enumerate(self.processes) if p.poll() is not None]

    def stop(self) -> None:
        """Stop every component (router first: no request reaches a stopping server)."""
        if self.router is not None:
            stop_process_group(self.router, grace_s=5.0)
            self.router = None
        for process in self.processes:
            _stop_group(process)
        if self.master is not None:
            self.master.kill()
            self.master = None

    def pids(self) -> dict[str, int]:
        found = {f"server {i}": p.pid for i, p in enumerate(self.processes)}
        if self.router is not None:
            found["router"] = self.router.pid
        return found

    def _log(self, i: int) -> Path:
        return self.log_dir / f"server-{i}.log"


def _stop_group(process: ServerProcess) -> None:
    """Stop a server's process group; when its leader is gone already (crashed, killed), what
    SGLang started under it (scheduler, detokenizer) is killed too."""
    if process.poll() is None:
        stop_process_group(process)
    else:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="hicache-ext-cluster",
        description="A local cluster: Mooncake master and store, N SGLang servers with the "
        "extension sharing one chunk tier, SGLang's router in front. Flags after -- go to "
        "every server.",
    )
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--model", required=True, help="model folder")
    parser.add_argument("--port", type=int, default=30000, help="the router's port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--policy", default="cache_aware", help="smg's routing policy")
    parser.add_argument(
        "--store-bytes", type=int, default=1 << 30, help="memory the store process lends"
    )
    parser.add_argument(
        "--settings", default="{}", help="extension settings (JSON) for every server"
    )
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    parser.add_argument("--log-dir", type=Path)
    parser.add_argument(
        "--no-shared-tier", action="store_true", help="per-server chunk tiers (no Mooncake)"
    )
    parser.add_argument("--smg", help="the router's binary (default: smg on PATH)")
    argv = list(sys.argv[1:] if argv is None else argv)
    passed = argv[argv.index("--") + 1 :] if "--" in argv else []
    ours = argv[: argv.index("--")] if "--" in argv else argv
    return parser.parse_args(ours), passed


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args, server_args = parse_args(argv)
    try:
        try:
            settings = json.loads(args.settings)
        except ValueError as error:
            raise ValueError(f"--settings is not JSON: {error}") from None
        if not isinstance(settings, dict):
            raise ValueError(f"--settings must be a JSON object, got {args.settings}")
        try:  # checked here: a bad key would stop every server's launch, one after another
            ExtensionSettings.model_validate(settings)
        except ValidationError as error:
            raise ValueError(f"--settings: {one_line(error, ExtensionSettings)}") from None
        spec = ClusterSpec(
            model_path=args.model,
            servers=args.servers,
            port=args.port,
            host=args.host,
            policy=args.policy,
            store_bytes=args.store_bytes,
            settings=settings,
            server_args=tuple(server_args),
            max_total_tokens=args.max_total_tokens,
            log_dir=args.log_dir,
            shared_tier=not args.no_shared_tier,
            smg=args.smg,
        )
    except (ValueError, ClusterError) as error:
        print(f"hicache-ext-cluster: {error}", file=sys.stderr)
        return 2
    cluster = LocalCluster(spec)
    previous = exit_on_sigterm()
    began = time.monotonic()
    try:
        cluster.start()
        if cluster.master is not None:
            print(
                f"mooncake master: {cluster.master.address} (store lends {spec.store_bytes} bytes)"
            )
        for i, config in enumerate(cluster.configs):
            cores = ",".join(map(str, cluster.cores[i]))
            print(f"server {i}: {config.url} pid {cluster.processes[i].pid} cores {cores}")
        router_pid = cluster.router.pid if cluster.router else "?"
        print(f"router: {cluster.url} pid {router_pid} model {cluster.model_name}")
        print(f"ready in {time.monotonic() - began:.1f} s; logs {cluster.log_dir}", flush=True)
        restarted_at: dict[int, float] = {}
        while True:
            time.sleep(1.0)
            for i in cluster.exited():
                # A server that dies again at once (a crash at start) is retried every 30 s.
                if time.monotonic() - restarted_at.get(i, -RETRY_S) < RETRY_S:
                    continue
                code = cluster.processes[i].returncode
                logger.warning("server %d exited (%s): starting it again (log %s)", i, code,
                               cluster.log_dir / f"server-{i}.log")  # fmt: skip
                restarted_at[i] = time.monotonic()
                cluster.restart_server(i, wait=False)
    except ClusterError as error:
        print(f"hicache-ext-cluster: {error}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, SystemExit):
        return 0
    finally:
        cluster.stop()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
