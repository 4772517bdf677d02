"""Simulating configurations in parallel worker processes, each simulated once."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from sglang_hicache_ext.tuning.cost import Pricing
from sglang_hicache_ext.tuning.pareto.space import Point
from sglang_hicache_ext.tuning.sim.profile import Profile
from sglang_hicache_ext.tuning.sim.result import SimResult
from sglang_hicache_ext.tuning.sim.simulator import simulate
from sglang_hicache_ext.tuning.trace import SimRequest, load_requests


class Evaluation(NamedTuple):
    point: Point
    result: SimResult

    @property
    def objectives(self) -> tuple[float, float, float]:
        """(mean TTFT s, -throughput tok/s, cost USD), all to be minimised."""
        r = self.result
        return (r.mean_ttft_s, -r.throughput_tok_s, r.cost.total_usd)


def objective_matrix(evaluations: Iterable[Evaluation]) -> np.ndarray:
    rows = [e.objectives for e in evaluations]
    return np.asarray(rows, dtype=float).reshape(-1, 3)


@dataclass(frozen=True)
class Workload:
    """What every simulation shares: the trace, the instance count and the models."""

    trace: Path
    instances: int
    limit: int | None = None
    profile: Profile = Profile()
    pricing: Pricing = Pricing()

    def __post_init__(self) -> None:
        if isinstance(self.instances, bool) or self.instances < 1:
            raise ValueError(f"instances must be >= 1, got {self.instances!r}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1 request, got {self.limit!r}")


# Each worker loads the trace once (initializer), then simulates many configurations.
_WORKLOAD: Workload | None = None
_REQUESTS: list[SimRequest] = []


def _init_worker(workload: Workload) -> None:
    global _WORKLOAD, _REQUESTS
    _WORKLOAD = workload
    _REQUESTS = load_requests(workload.trace, workload.limit)


def _simulate_point(point: Point) -> SimResult:
    assert _WORKLOAD is not None, "worker not initialised"
    config = point.sim_config(_WORKLOAD.instances)
    return simulate(_REQUESTS, config, _WORKLOAD.profile, _WORKLOAD.pricing)


class PointEvaluator(ABC):
    """Turns configurations into simulation results, each point simulated at most once."""

    @abstractmethod
    def evaluate(self, points: Iterable[Point]) -> list[Evaluation]:
        """Results for `points`, in order, duplicates removed."""


class Evaluator(PointEvaluator):
    """Memoised simulation in a pool of worker processes.

    `progress`, if given, is called with 1 after each new simulation (e.g. a tqdm bar's `update`).
    """

    def __init__(
        self,
        workload: Workload,
        workers: int = 2,
        progress: Callable[[int], object] | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        load_requests(workload.trace, workload.limit)  # fail here, clearly, on a bad trace
        self.workload = workload
        self._pool = ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(workload,))
        self._results: dict[Point, SimResult] = {}
        self._progress = progress

    def __enter__(self) -> Evaluator:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown()

    @property
    def simulated(self) -> int:
        return len(self._results)

    def evaluate(self, points: Iterable[Point]) -> list[Evaluation]:
        wanted = list(dict.fromkeys(points))
        missing = [p for p in wanted if p not in self._results]
        for point, result in zip(missing, self._pool.map(_simulate_point, missing), strict=True):
            self._results[point] = result
            if self._progress is not None:
                self._progress(1)
        return [Evaluation(p, self._results[p]) for p in wanted]
