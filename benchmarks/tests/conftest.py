"""Fixtures of the benchmarks' self-checks: the tests of code that lives in benchmarks/ (its timers,
its work counts, a small run of a benchmark), kept beside it so that tests/ imports no benchmark.
`make test` runs them with the rest (pyproject.toml's `testpaths`). The fixtures are the test
suite's own (a conftest's imported fixtures are registered like its own)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(
    0, str(REPO)
)  # `benchmarks`, `scripts` and `tests` import from the repository's root

from tests.conftest import one_torch_thread, smollm2_path  # noqa: E402

__all__ = ["one_torch_thread", "smollm2_path"]
