"""The production request traces (Mooncake-style JSONL, one request per line) and their two views.

- `load_requests`, the simulator's view: arrival, prompt and output lengths, blocks. Strict: a
  malformed line raises `TraceError` with its line number, since a silently shortened trace would
  skew every latency the simulator reports.
- `load_trace`, the TTL replay's view: time and blocks only (`timestamp`, `hash_ids`). Lenient: a
  malformed line is skipped, counted and logged, so one bad line does not lose an hour-long trace.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from operator import itemgetter
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

logger = logging.getLogger(__name__)

_T = TypeVar("_T", bound=tuple)


class TraceError(ValueError):
    """A trace line that cannot be used."""


class SimRequest(NamedTuple):
    arrival_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[str, ...]  # one id per block of the prompt; equal ids are reusable prefixes


class TraceRequest(NamedTuple):
    time_s: float
    pages: tuple[str, ...]  # one key per block; equal keys are the same reusable prefix block


class Trace(NamedTuple):
    requests: list[TraceRequest]  # sorted by time
    skipped_lines: int  # malformed lines, logged and left out

    @property
    def accesses(self) -> int:
        return sum(len(r.pages) for r in self.requests)


def load_requests(path: str | Path, limit: int | None = None) -> list[SimRequest]:
    """Requests of a JSONL trace (`timestamp` ms, `input_length`, `output_length`, `hash_ids`).

    Sorted by arrival (stable); `limit` keeps the first requests of the file.
    """

    def refuse(number: int, error: Exception) -> None:
        raise TraceError(f"{path}:{number}: malformed trace line: {error}") from None

    return _load(path, parse_request, refuse, limit)


def load_trace(path: str | Path) -> Trace:
    """Time and blocks of each request (`timestamp` ms, `hash_ids`); other fields are ignored.

    Malformed lines (bad JSON, missing or mistyped fields, negative time) are skipped, counted and
    logged.
    """
    skipped: list[int] = []

    def skip(number: int, error: Exception) -> None:
        skipped.append(number)
        logger.warning("%s:%d: malformed trace line skipped: %s", path, number, error)

    requests = _load(path, parse_block_request, skip, None)
    if skipped:
        logger.warning("%s: %d malformed line(s) skipped", path, len(skipped))
    return Trace(requests, len(skipped))


def parse_request(record: Any) -> SimRequest:
    _require(record, ("timestamp", "input_length", "output_length", "hash_ids"))
    arrival_s = _seconds(record["timestamp"])
    inputs, outputs = record["input_length"], record["output_length"]
    if not _is_int(inputs) or inputs < 1:
        raise TraceError(f"input_length must be an integer >= 1, got {inputs!r}")
    if not _is_int(outputs) or outputs < 0:
        raise TraceError(f"output_length must be an integer >= 0, got {outputs!r}")
    return SimRequest(arrival_s, inputs, outputs, _blocks(record["hash_ids"], non_empty=True))


def parse_block_request(record: Any) -> TraceRequest:
    _require(record, ("timestamp", "hash_ids"))
    return TraceRequest(_seconds(record["timestamp"]), _blocks(record["hash_ids"], non_empty=False))


def _load(
    path: str | Path,
    parse: Callable[[Any], _T],
    on_error: Callable[[int, Exception], None],
    limit: int | None,
) -> list[_T]:
    """Parsed lines sorted by time (stable: file order for equal times); blank lines ignored."""
    requests: list[_T] = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                requests.append(parse(json.loads(line)))
            except (json.JSONDecodeError, TraceError) as error:
                on_error(number, error)
    requests.sort(key=itemgetter(0))  # both views hold the time first
    return requests


def _require(record: Any, fields: tuple[str, ...]) -> None:
    if not isinstance(record, dict):
        raise TraceError("expected a JSON object")
    missing = [k for k in fields if k not in record]
    if missing:
        raise TraceError(f"missing field(s) {', '.join(missing)}")


def _seconds(timestamp: Any) -> float:
    """A trace timestamp (milliseconds) in seconds."""
    if not _is_number(timestamp) or timestamp < 0:
        raise TraceError(f"timestamp must be a number >= 0, got {timestamp!r}")
    return float(timestamp) / 1000.0


def _blocks(hash_ids: Any, non_empty: bool) -> tuple[str, ...]:
    if not isinstance(hash_ids, list) or (non_empty and not hash_ids):
        raise TraceError(f"hash_ids must be a{' non-empty' if non_empty else ''} list")
    if not all(_is_int(h) or isinstance(h, str) for h in hash_ids):
        raise TraceError("hash_ids must hold integers or strings")
    return tuple(str(h) for h in hash_ids)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
