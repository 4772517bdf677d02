"""Strict loader of Mooncake-style request traces for the simulator.

Unlike the TTL replay (which only needs block ids and skips bad lines), the simulator needs
lengths too and refuses a malformed line with its line number: a silently shortened trace would
skew every latency it reports.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

# The shared traces live beside the repository checkout: <repo>/../shared/data/traces.
TRACES_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "traces"
CONVERSATION_TRACE = TRACES_DIR / "mooncake_conversation_trace.jsonl"


class TraceError(ValueError):
    """A trace line the simulator cannot use."""


class SimRequest(NamedTuple):
    arrival_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[str, ...]  # one id per block of the prompt; equal ids are reusable prefixes


def load_requests(path: str | Path, limit: int | None = None) -> list[SimRequest]:
    """Requests of a JSONL trace (`timestamp` ms, `input_length`, `output_length`, `hash_ids`).

    Sorted by arrival (stable); `limit` keeps the first requests of the file.
    """
    requests: list[SimRequest] = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                requests.append(parse_request(json.loads(line)))
            except (json.JSONDecodeError, TraceError) as err:
                raise TraceError(f"{path}:{number}: malformed trace line: {err}") from None
    requests.sort(key=lambda r: r.arrival_s)
    return requests


def parse_request(record: Any) -> SimRequest:
    if not isinstance(record, dict):
        raise TraceError("expected a JSON object")
    missing = [
        k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in record
    ]
    if missing:
        raise TraceError(f"missing field(s) {', '.join(missing)}")
    timestamp, inputs, outputs, hashes = (
        record["timestamp"],
        record["input_length"],
        record["output_length"],
        record["hash_ids"],
    )
    if not _is_number(timestamp) or timestamp < 0:
        raise TraceError(f"timestamp must be a number >= 0, got {timestamp!r}")
    if not _is_int(inputs) or inputs < 1:
        raise TraceError(f"input_length must be an integer >= 1, got {inputs!r}")
    if not _is_int(outputs) or outputs < 0:
        raise TraceError(f"output_length must be an integer >= 0, got {outputs!r}")
    if not isinstance(hashes, list) or not hashes:
        raise TraceError("hash_ids must be a non-empty list")
    if not all(_is_int(h) or isinstance(h, str) for h in hashes):
        raise TraceError("hash_ids must hold integers or strings")
    return SimRequest(float(timestamp) / 1000.0, inputs, outputs, tuple(str(h) for h in hashes))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
