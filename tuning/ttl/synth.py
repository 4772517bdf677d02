"""Synthetic Mooncake-style traces: sessions of turns under per-app system prompts.

A request's blocks form a prefix path: the blocks every request shares, its app's system prompt,
the session's earlier turns, then the turn's new blocks (the Mooncake traces' `hash_ids`: an equal
id means an equal prefix). Sessions arrive as a Poisson process (faster inside bursts), pick an
app by a Zipf law over a popularity order that is re-shuffled every `drift_every_s`, and come
back after log-normal think times whose median is scaled per app, so that apps (the subtrees the
TTL planner groups by) differ in reuse when `gap_spread` > 0.

    python -m sglang_hicache_ext.tuning.ttl synth --shape chat --out chat.jsonl
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

BLOCK_TOKENS = 512  # tokens per hash id, as in the Mooncake traces


@dataclass(frozen=True)
class TraceShape:
    """Knobs of a synthetic trace (times in seconds)."""

    duration_s: float = 3600.0
    requests_per_s: float = 1.1  # mean arrival rate of requests (turns), bursts included
    apps: int = 200  # distinct system prompts: the subtrees under the shared blocks
    app_skew: float = 1.0  # Zipf exponent of app popularity (0: uniform)
    shared_blocks: int = 1  # blocks at the head of every request
    app_blocks: int = 4  # system-prompt blocks of each app
    session_turns: float = 4.0  # mean turns of a session (geometric, >= 1)
    turn_gap_s: float = 60.0  # median think time between two turns
    gap_sigma: float = 1.0  # log-normal sigma of one think time
    gap_spread: float = 1.0  # log-normal sigma of an app's think-time multiplier (0: all alike)
    new_blocks: float = 3.0  # mean new blocks of a turn (Poisson, >= 1)
    max_blocks: int = 128  # a session stops growing here (context window)
    burst_factor: float = 1.0  # arrival-rate multiplier inside bursts (1: no bursts)
    burst_every_s: float = 600.0
    burst_length_s: float = 60.0
    drift_every_s: float = 0.0  # popularity order re-shuffled this often (0: never)
    seed: int = 0

    def __post_init__(self) -> None:
        positive = ("duration_s", "requests_per_s", "turn_gap_s", "burst_every_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        non_negative = ("app_skew", "gap_sigma", "gap_spread", "drift_every_s", "burst_length_s")
        for name in non_negative:
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.apps < 1 or self.app_blocks < 1 or self.shared_blocks < 0:
            raise ValueError("apps and app_blocks must be >= 1, shared_blocks >= 0")
        if self.session_turns < 1 or self.new_blocks < 1 or self.burst_factor < 1:
            raise ValueError("session_turns, new_blocks and burst_factor must be >= 1")
        if self.max_blocks <= self.shared_blocks + self.app_blocks:
            raise ValueError("max_blocks must exceed shared_blocks + app_blocks")


# Shapes that differ where group TTLs are won or lost.
SHAPES: dict[str, TraceShape] = {
    # Many apps whose users come back at different paces: groups differ in reuse.
    "chat": TraceShape(),
    # Load spikes and a popularity order that changes every quarter hour: plans go stale.
    "bursty": TraceShape(burst_factor=4.0, drift_every_s=900.0, gap_spread=0.8, seed=1),
    # Few apps, all alike: groups carry no information a single TTL lacks.
    "uniform": TraceShape(apps=20, app_skew=0.0, gap_spread=0.0, seed=2),
    # Knobs fitted to the conversation trace's statistics (benchmarks/trace_shapes.py): ~24
    # blocks per request, ~38 % of accesses reuses, median reuse interval ~100 s, top 1 % of
    # blocks ~13 % of accesses.
    "production-like": TraceShape(
        requests_per_s=3.3,
        apps=1000,
        app_skew=0.8,
        app_blocks=2,
        session_turns=1.5,
        turn_gap_s=180.0,
        gap_sigma=0.8,
        new_blocks=14.0,
        seed=5,
    ),
    # Agent-like: long shared prompts, short quick sessions, a few hot apps.
    "agent": TraceShape(
        apps=40,
        app_skew=1.3,
        app_blocks=12,
        session_turns=2.0,
        turn_gap_s=15.0,
        gap_spread=1.2,
        new_blocks=2.0,
        seed=3,
    ),
}


def shape_named(name: str, **overrides: float | int) -> TraceShape:
    if name not in SHAPES:
        raise ValueError(f"unknown trace shape {name!r}; choose from {', '.join(SHAPES)}")
    return replace(SHAPES[name], **overrides)


def generate(shape: TraceShape) -> list[dict[str, object]]:
    """The requests of one trace, sorted by time, as Mooncake JSONL records."""
    rng = np.random.default_rng(shape.seed)
    session_rate = shape.requests_per_s / shape.session_turns
    weights = 1.0 / np.arange(1, shape.apps + 1) ** shape.app_skew
    weights /= weights.sum()
    pace = np.exp(rng.normal(0.0, shape.gap_spread, shape.apps))  # per-app think-time factor
    epochs = max(1, math.ceil(shape.duration_s / shape.drift_every_s)) if shape.drift_every_s else 1
    orders = [rng.permutation(shape.apps) for _ in range(epochs)]
    next_id = shape.shared_blocks
    app_prefix = []
    for _ in range(shape.apps):
        app_prefix.append(list(range(next_id, next_id + shape.app_blocks)))
        next_id += shape.app_blocks
    shared = list(range(shape.shared_blocks))

    records: list[tuple[float, list[int], int]] = []
    for start in _session_starts(shape, session_rate, rng):
        epoch = min(int(start // shape.drift_every_s), epochs - 1) if shape.drift_every_s else 0
        app = int(orders[epoch][rng.choice(shape.apps, p=weights)])
        turns = int(rng.geometric(1.0 / shape.session_turns))
        path = shared + app_prefix[app]
        time_s = start
        for turn in range(turns):
            if turn:
                gap = shape.turn_gap_s * pace[app] * math.exp(rng.normal(0.0, shape.gap_sigma))
                time_s += gap
            if time_s >= shape.duration_s or len(path) >= shape.max_blocks:
                break
            grow = min(max(1, int(rng.poisson(shape.new_blocks))), shape.max_blocks - len(path))
            path = path + list(range(next_id, next_id + grow))
            next_id += grow
            records.append((time_s, path, int(rng.integers(16, 800))))
    records.sort(key=lambda record: record[0])
    return [
        {
            "timestamp": int(round(time_s * 1000)),
            "input_length": len(path) * BLOCK_TOKENS,
            "output_length": output,
            "hash_ids": path,
        }
        for time_s, path, output in records
    ]


def _session_starts(shape: TraceShape, rate: float, rng: np.random.Generator) -> Iterator[float]:
    """Poisson arrivals whose rate is `burst_factor` times higher inside bursts, scaled so the
    mean rate over a burst cycle stays `rate` (thinning of the peak-rate process)."""
    share = min(shape.burst_length_s / shape.burst_every_s, 1.0)
    base = rate / (1.0 + share * (shape.burst_factor - 1.0))
    peak = base * shape.burst_factor
    time_s = 0.0
    while True:
        time_s += rng.exponential(1.0 / peak)
        if time_s >= shape.duration_s:
            return
        in_burst = (time_s % shape.burst_every_s) < shape.burst_length_s
        if in_burst or rng.random() < base / peak:
            yield time_s


def write_trace(shape: TraceShape, path: str | Path) -> int:
    """Write the trace as JSONL; returns the number of requests."""
    records = generate(shape)
    with Path(path).open("w") as out:
        for record in records:
            out.write(json.dumps(record) + "\n")
    return len(records)


def describe(shape: TraceShape) -> dict[str, object]:
    return asdict(shape)
