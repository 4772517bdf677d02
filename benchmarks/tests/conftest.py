"""Fixtures of the benchmarks' self-checks: the tests of code that lives in benchmarks/ (its timers,
its work counts, a small run of a benchmark), kept beside it so that tests/ imports no benchmark.
`make test` runs them with the rest (pyproject.toml's `testpaths`)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # `benchmarks` and `scripts` import from the repository's root

from scripts.prepare_models import SMOLLM2, prepare  # noqa: E402


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread for a module: the 2 cores are shared with servers and other jobs."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return prepare(SMOLLM2)
