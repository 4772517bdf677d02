"""The suite's own xdist scheduling (tests/parallel_workers.py) with real pytest-xdist workers:
a test that hangs is stopped, reported failed once, and does not take the rest of the suite (or
CI's time) with it; what its worker started is stopped."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from tests.parallel_workers import GROUPS_ENV, stop_processes_of

ROOT = Path(__file__).resolve().parents[1]

# The suite's hooks, without the rest of its conftest (no torch, no SGLang: workers start in
# a second instead of a minute).
CONFTEST = """
import pytest

from tests import parallel_workers

parallel_workers.prepare_this_process()


def pytest_xdist_make_scheduler(config, log):
    return parallel_workers.make_scheduler(config, log)


def pytest_testnodedown(node, error):
    parallel_workers.worker_down(node, error)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    return parallel_workers.set_timeout_timer(item, settings)


def pytest_collection_modifyitems(config, items):
    if parallel_workers.worker_index() is not None:
        parallel_workers.group_items(items)
"""

HANGING = """
import os, subprocess, time
from pathlib import Path


def test_hangs():
    child = subprocess.Popen(["sleep", "600"], start_new_session=True)  # a server, say
    Path("child.pid").write_text(str(child.pid))
    fork = os.fork()  # a plain fork holds the worker's pipe to the controller open
    if fork == 0:
        time.sleep(600)
        os._exit(0)
    Path("fork.pid").write_text(str(fork))
    time.sleep(600)


def test_after_the_hang_in_the_same_file():
    assert True
"""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")  # killed; reaped or not by whoever adopted it


def test_a_hanging_test_fails_once_and_the_suite_goes_on(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_hanging.py").write_text(HANGING)
    (tmp_path / "test_other.py").write_text("def test_other():\n    assert True\n")
    began = time.monotonic()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-n",
            "2",
            "-p",
            "no:cacheprovider",
            "-o",
            "timeout=4",
            "-o",
            "timeout_method=thread",
        ],
        cwd=tmp_path,
        env={**_outside_this_run(os.environ), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert re.search(r"\b1 failed, 2 passed\b", out), out
    assert "crashed while running 'test_hanging.py::test_hangs'" in out, out
    # xdist's scope scheduling hands the crashed test out again, crashing worker after worker
    assert out.count("replacing crashed worker") == 1, out
    assert _gone(int((tmp_path / "child.pid").read_text())), out
    assert _gone(int((tmp_path / "fork.pid").read_text())), out
    assert time.monotonic() - began < 120, out


def _outside_this_run(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment without this run's xdist and group-map variables: the nested run is its
    own controller."""
    ours = ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_TESTRUNUID", "PYTEST_XDIST_WORKER_COUNT")
    return {
        name: value for name, value in environ.items() if name not in ours and name != GROUPS_ENV
    }


def test_only_the_processes_of_the_workers_run_are_stopped() -> None:
    def start(worker: str, run: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTEST_XDIST_WORKER": worker, "PYTEST_XDIST_TESTRUNUID": run}
        return subprocess.Popen(["sleep", "60"], env=env, start_new_session=True)

    ours, other_worker, other_run = start("gw7", "r1"), start("gw8", "r1"), start("gw7", "r2")
    try:
        assert stop_processes_of("gw7", "r1") == 1
        assert ours.wait(timeout=10) == -9
        assert other_worker.poll() is None and other_run.poll() is None
    finally:
        for process in (ours, other_worker, other_run):
            process.kill()
            process.wait()
