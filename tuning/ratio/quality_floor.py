"""The quality floor: the smallest recompute ratio at which fusion keeps a model's answers.

Measured by `benchmarks/fusion_retention.py` (answer F1 retention against the full prefill on
HotpotQA) and stored per model in `quality_floors.json` beside this file, so that a ratio tuner
never goes below it. The floor is the smallest measured ratio from which *every* larger measured
ratio also keeps the target retention: one lucky low ratio in a noisy curve does not set it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

FLOORS_FILE = Path(__file__).with_name("quality_floors.json")
TARGET_RETENTION = 0.95


class CurvePoint(NamedTuple):
    """One selector at one ratio: mean F1 retention over `questions` with its 95 % interval."""

    ratio: float
    retention: float
    retention_ci95: tuple[float, float]
    questions: int


class QualityFloor(NamedTuple):
    """A model's floor: `ratio` is None when no measured ratio kept the target retention."""

    model: str
    selector: str
    ratio: float | None
    target_retention: float
    curve: tuple[CurvePoint, ...]
    dtype: str
    source: str


def floor_from_curve(curve: Sequence[CurvePoint], target: float = TARGET_RETENTION) -> float | None:
    """Smallest ratio whose retention, and that of every larger measured ratio, reaches target."""
    floor: float | None = None
    for point in sorted(curve, key=lambda p: p.ratio, reverse=True):
        if point.retention < target:
            break
        floor = point.ratio
    return floor


def ratio_curve(summary: dict[str, dict[str, Any]], selector: str) -> tuple[CurvePoint, ...]:
    """F1 retention of `selector` (e.g. "a3+sink4") at every ratio a retention summary measured
    (`evaluation/retention.py: summarise`, methods named `<selector>@<ratio>`)."""
    curve = []
    for method, values in summary.items():
        name, _, ratio = method.partition("@")
        if name == selector and ratio.replace(".", "", 1).isdigit():  # no codec, no eviction
            low, high = values["retention_ci95"]
            curve.append(
                CurvePoint(float(ratio), values["retention"], (low, high), values["questions"])
            )
    return tuple(sorted(curve))


def quality_floor(model: str, path: Path = FLOORS_FILE) -> QualityFloor | None:
    """The stored floor of `model` (its directory name, e.g. "Qwen2.5-Coder-0.5B-Instruct")."""
    if not path.exists():
        return None
    entry = json.loads(path.read_text()).get(model)
    if entry is None:
        return None
    curve = tuple(
        CurvePoint(p["ratio"], p["retention"], tuple(p["retention_ci95"]), p["questions"])
        for p in entry["curve"]
    )
    return QualityFloor(**{**entry, "model": model, "curve": curve})


def record_floor(floor: QualityFloor, path: Path = FLOORS_FILE) -> None:
    """Store (or replace) one model's floor; other models' entries are kept."""
    floors = json.loads(path.read_text()) if path.exists() else {}
    entry = floor._asdict()
    del entry["model"]
    entry["curve"] = [point._asdict() for point in floor.curve]
    floors[floor.model] = entry
    path.write_text(json.dumps(floors, indent=1, sort_keys=True) + "\n")
