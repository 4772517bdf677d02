"""Background jobs run in order, each on a thread of its own that ends with the job.

Used where a background thread runs torch ops beside a forward on the same cores: capture's
preparation of pieces (`sglang_ext/chunk_fusion/auto_capture.py`) and the chunk tiers'
promotions from disk (`chunk_tiers.py`). `research/omp_background_thread.py` measures why.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

_T = TypeVar("_T")


class ShortLivedWorker:
    """Runs jobs one at a time, in order, each on a thread of its own that ends with the job.

    Why not a `ThreadPoolExecutor`: a thread that stays alive after running torch ops keeps its
    OpenMP team, and libgomp, counting more threads than cores, then makes every team stop
    spinning between parallel regions, so each of a forward's thousands of regions wakes its
    workers through the kernel. Measured on SmolLM2-135M (CPU, 2 cores): a capturing server's
    scheduler made 4,500 voluntary context switches a prompt with a pool thread, 1,600 with
    threads that end (1,500 keeping nothing; docs/auto-chunks.md). A thread that ends frees its
    team; a job's thread waits for the one before it, so jobs still finish in order."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._last: threading.Thread | None = None

    def submit(self, job: Callable[..., _T], *args: Any) -> Future[_T]:
        future: Future[_T] = Future()
        previous = self._last

        def run() -> None:
            if previous is not None:
                previous.join()
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(job(*args))
            except BaseException as err:  # handed to whoever reads the future
                future.set_exception(err)

        # A daemon: a server stopping mid-job does not wait for work nobody will use.
        self._last = threading.Thread(target=run, name=self._name, daemon=True)
        self._last.start()
        return future
