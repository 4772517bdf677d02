"""Loading Mooncake-style request traces (one JSON object per line)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import NamedTuple

logger = logging.getLogger(__name__)


class TraceRequest(NamedTuple):
    time_s: float
    pages: tuple[str, ...]  # one key per block; equal keys are the same reusable prefix block


class Trace(NamedTuple):
    requests: list[TraceRequest]  # sorted by time
    skipped_lines: int  # malformed lines, logged and left out

    @property
    def accesses(self) -> int:
        return sum(len(r.pages) for r in self.requests)


def load_trace(path: str | Path) -> Trace:
    """Read `timestamp` (ms) and `hash_ids`; other fields are ignored.

    Malformed lines (bad JSON, missing or mistyped fields, negative time) are skipped, counted and
    logged, so one bad line does not lose an hour-long trace.
    """
    requests: list[TraceRequest] = []
    skipped = 0
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            request = _parse(line)
            if request is None:
                skipped += 1
                logger.warning("%s:%d: malformed trace line skipped", path, number)
                continue
            requests.append(request)
    requests.sort(key=lambda r: r.time_s)  # stable: keeps file order for equal timestamps
    if skipped:
        logger.warning("%s: %d malformed line(s) skipped", path, skipped)
    return Trace(requests, skipped)


def _parse(line: str) -> TraceRequest | None:
    try:
        record = json.loads(line)
        timestamp = record["timestamp"]
        hash_ids = record["hash_ids"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return None
    if isinstance(timestamp, bool) or not isinstance(timestamp, int | float) or timestamp < 0:
        return None
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int | str) and not isinstance(h, bool) for h in hash_ids
    ):
        return None
    return TraceRequest(float(timestamp) / 1000.0, tuple(str(h) for h in hash_ids))
