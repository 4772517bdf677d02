"""A search's results on disk: `frontier.json` (every simulated configuration, the non-dominated
ones, hypervolume) and its plot `frontier.png`, written together and read back to re-plot."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from sglang_hicache_ext.tuning.pareto.evaluator import Evaluation, objective_matrix
from sglang_hicache_ext.tuning.pareto.front import pareto_mask
from sglang_hicache_ext.tuning.pareto.hypervolume import hypervolume, reference_point
from sglang_hicache_ext.tuning.pareto.plot import plot_frontier
from sglang_hicache_ext.tuning.pareto.space import Point
from sglang_hicache_ext.tuning.sim.result import SimResult

JSON_NAME = "frontier.json"
PNG_NAME = "frontier.png"


class FrontierFile(NamedTuple):
    meta: dict[str, Any]  # what the writer passed: trace, instances, search, ...
    evaluated: list[Evaluation]
    frontier: list[Evaluation]


def write_frontier(
    evaluated: Sequence[Evaluation], out: Path, meta: Mapping[str, Any]
) -> list[Evaluation]:
    """Write `frontier.json` and `frontier.png` under `out`; returns the non-dominated ones.

    `meta` holds at least `trace`, `instances` and `search` (they title the plot).
    """
    matrix = objective_matrix(evaluated)
    frontier = [e for e, keep in zip(evaluated, pareto_mask(matrix), strict=True) if keep]
    reference = reference_point(matrix)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        **meta,
        "simulations": len(evaluated),
        "objectives": ["mean_ttft_s", "-throughput_tok_s", "cost_usd"],
        "reference_point": reference.tolist(),
        "hypervolume": hypervolume(objective_matrix(frontier), reference),
        "frontier": [_entry(e) for e in frontier],
        "evaluated": [_entry(e) for e in evaluated],
    }
    (out / JSON_NAME).write_text(json.dumps(report, indent=1) + "\n")
    plot_frontier(evaluated, frontier, out / PNG_NAME, frontier_title(meta, len(evaluated)))
    return frontier


def read_frontier(folder: Path) -> FrontierFile:
    report = json.loads((folder / JSON_NAME).read_text())
    meta = {k: v for k, v in report.items() if k not in ("frontier", "evaluated")}
    return FrontierFile(
        meta,
        [_evaluation(entry) for entry in report["evaluated"]],
        [_evaluation(entry) for entry in report["frontier"]],
    )


def replot_frontier(folder: Path, path: Path | None = None) -> Path:
    """Draw `folder`'s `frontier.json` again (to `path`, default its `frontier.png`)."""
    saved = read_frontier(folder)
    path = path or folder / PNG_NAME
    title = frontier_title(saved.meta, len(saved.evaluated))
    plot_frontier(saved.evaluated, saved.frontier, path, title)
    return path


def frontier_title(meta: Mapping[str, Any], simulations: int) -> str:
    trace = Path(str(meta["trace"])).name
    return f"{trace}, {meta['instances']} instance(s), {meta['search']}: {simulations} sims"


def _entry(evaluation: Evaluation) -> dict[str, Any]:
    return {"config": evaluation.point._asdict(), "result": evaluation.result.to_json()}


def _evaluation(entry: Mapping[str, Any]) -> Evaluation:
    return Evaluation(Point(**entry["config"]), SimResult.from_json(entry["result"]))
