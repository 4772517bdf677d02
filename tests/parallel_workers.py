"""How the suite runs on several cores (`make test`: pytest-xdist, `-n auto`).

An SGLang CPU server's prefill gains little from a second core (tests/test_server_fusion.py:
189 s on two cores, 229 s on one), so the suite runs one xdist worker per core and every torch
in it, its servers' included (they inherit the environment), on one OpenMP thread per worker's
share of the cores. The workers are not pinned: a core whose worker waits (a server starting,
a TTL to expire) runs the other's processes. Measured on the 2-core machine, the whole suite:
1089 s in one process, 826 s with each worker pinned to its core, 735 s unpinned (1,349 of its
1,470 core-seconds busy).

Tests are handed out in groups (`GroupScheduling`): a test file's tests stay together
(module-scoped servers), and the files that share a session server (`SHARED_FIXTURES`) form one
group, so each shared server starts once, on one worker, and is stopped after its last user
there (tests/shared_servers.py). Groups are queued heaviest first (server tests count), so the
long ones do not start last. Workers compute the groups while collecting and write them to a
file the controller reads (xdist's own `--dist loadgroup` marks do not reach its scheduler on
pytest 9.2: pytest-dev/pytest-xdist#1386).

A test that hangs is stopped by pytest-timeout (pyproject.toml), which ends its worker; the
scheduler reports that test failed without handing it out again, requeues the rest of the
worker's groups for a new worker, and what the old one started is killed (by the worker itself
before it exits, `stop_descendants`, and by the controller after any crash, `worker_down`).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest

# The session servers of tests/conftest.py that several test files share.
SHARED_FIXTURES = ("hicache_server", "disk_server", "chunked_prefill_server", "tiny_qwen2_server")
# Most workers `-n auto` starts: each holds a forked SGLang and its servers (GBs).
MAX_WORKERS = 4
# Where the workers write {test id: group} for the controller (set by the controller, inherited).
GROUPS_ENV = "HICACHE_EXT_TEST_GROUPS"


def worker_index() -> int | None:
    """This process's xdist worker number, None outside a worker."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return int(worker.removeprefix("gw")) if worker else None


def is_controller(config: pytest.Config) -> bool:
    """Whether this process hands tests to xdist workers (and so runs none itself)."""
    return worker_index() is None and getattr(config.option, "numprocesses", None) not in (None, 0)


def prepare_this_process() -> None:
    """In a worker, size OpenMP to the worker's share of the cores before torch is imported (it
    sizes its pool once, from OMP_NUM_THREADS, here and in each server the worker starts);
    elsewhere, name the file the workers will write the groups to."""
    if worker_index() is None:
        os.environ.setdefault(
            GROUPS_ENV, str(Path(tempfile.gettempdir()) / f"test-groups-{os.getpid()}.json")
        )
        return
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = len(os.sched_getaffinity(0))
    os.environ["OMP_NUM_THREADS"] = str(max(1, cores // workers))


def auto_workers() -> int:
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


def group_items(items: list[pytest.Item]) -> None:
    """Order the tests groups heaviest first (keeping each group's own order) and write each
    test's group for the controller."""
    files = list(dict.fromkeys(item.path for item in items))
    parent = {path: path for path in files}

    def root(path: Path) -> Path:
        while parent[path] != path:
            path = parent[path]
        return path

    first_user: dict[str, Path] = {}
    for item in items:
        for name in SHARED_FIXTURES:
            if name in getattr(item, "fixturenames", ()):
                other = first_user.setdefault(name, item.path)
                parent[root(item.path)] = root(other)
    weight: dict[Path, int] = {}
    for item in items:
        group = root(item.path)
        weight[group] = weight.get(group, 0) + (100 if item.get_closest_marker("server") else 1)
    order = {group: i for i, group in enumerate(dict.fromkeys(root(item.path) for item in items))}
    items.sort(key=lambda item: (-weight[root(item.path)], order[root(item.path)]))
    index = worker_index()
    if index is not None and index >= int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")):
        return  # a replacement for a worker that went down: the controller has the map already
    target = Path(os.environ[GROUPS_ENV])
    partial = target.with_name(f"{target.name}.{os.getpid()}")
    partial.write_text(json.dumps({item.nodeid: str(root(item.path)) for item in items}))
    partial.replace(target)  # the workers write the same map; each write is whole


def stop_processes_of(worker: str, run: str) -> int:
    """SIGKILL what a worker that went down left running, found by the xdist worker and run ids
    in the environment each process was started with: what the worker started with exec
    (servers, the zygote and the servers it forks, their children, Mooncake masters). Its plain
    forks show no ids (xdist sets them after the worker starts): `stop_descendants` stops those
    while the worker still can. Returns how many were stopped."""
    marks = {"PYTEST_XDIST_WORKER": worker, "PYTEST_XDIST_TESTRUNUID": run}
    found = []
    for process in psutil.process_iter():
        try:
            environment = process.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if process.pid != os.getpid() and marks.items() <= environment.items():
            found.append(process)
    return _kill(found)


def stop_descendants() -> int:
    """SIGKILL every process below this one (its servers and their children, forks included),
    before this worker exits for a test that hung. Returns how many were stopped."""
    return _kill(psutil.Process().children(recursive=True))


def _kill(processes: list[psutil.Process]) -> int:
    stopped = 0
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
            stopped += 1
    return stopped


def time_out_after_stopping_descendants(item: pytest.Item, settings: Any) -> None:
    """pytest-timeout's thread method, with this worker's processes stopped first: a fork of the
    worker holds its pipe to the controller open, which would hide the worker's end."""
    import pytest_timeout

    stop_descendants()
    pytest_timeout.timeout_timer(item, settings)


def set_timeout_timer(item: pytest.Item, settings: Any) -> bool | None:
    """`pytest_timeout_set_timer` for the thread method (None: pytest-timeout's own)."""
    if settings.method != "thread":
        return None
    timer = threading.Timer(settings.timeout, time_out_after_stopping_descendants, (item, settings))
    timer.name = f"timeout {item.nodeid}"

    def cancel() -> None:
        timer.cancel()
        timer.join()

    item.cancel_timeout = cancel  # type: ignore[attr-defined]  # what pytest-timeout cancels
    timer.start()
    return True


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """xdist's scope scheduling with this suite's groups as the scopes, in the workers'
        order (heaviest first)."""

        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # every worker has collected (and written) by now
                path = Path(os.environ[GROUPS_ENV])
                self.groups = json.loads(path.read_text())
                path.unlink(missing_ok=True)
            return self.groups.get(nodeid) or nodeid.split("::", 1)[0]

        def remove_node(self, node: Any) -> str | None:
            """A worker that went down mid-test (a hang stopped by pytest-timeout, a crash):
            its test is reported failed and not handed out again (xdist's scope scheduling
            requeues it, so one hang would crash worker after worker), and the rest of its
            groups go back to the front of the queue (`worker_down` stops what it started)."""
            workload = self.assigned_work.pop(node)
            pending = [
                (scope, nodeid)
                for scope, unit in workload.items()
                for nodeid, done in unit.items()
                if not done
            ]
            if not pending:
                return None
            scope, crashed = pending[0]
            workload[scope][crashed] = True
            for scope, unit in reversed(workload.items()):
                if not all(unit.values()):
                    self.workqueue[scope] = unit
                    self.workqueue.move_to_end(scope, last=False)  # heaviest first still
            for other in self.assigned_work:
                self._reschedule(other)
            return crashed

        def _reschedule(self, node: Any) -> None:
            # A replacement worker still collecting has nothing to run tests from yet (xdist
            # would take a group for it and never send it: the run would wait forever);
            # `schedule()` hands it work once it has collected.
            if node in self.registered_collections:
                super()._reschedule(node)

    config.option.loadscopereorder = False
    return GroupScheduling(config, log)


def worker_down(node: Any, error: object) -> None:
    """`pytest_testnodedown`: after a worker crashed (never after a normal end), stop what it
    left running."""
    if error is not None:
        stop_processes_of(node.gateway.id, node.workerinput["testrunuid"])
