"""The TTL optimiser's state on disk, so a restarted server plans from the accesses before it.

What is kept is what a plan reads: the requests of the planning window (time + page path), the
measured bytes per page, and the last plan (its TTL table and grouping). Only the window is
kept, so the file is bounded by what the process holds in memory anyway; page keys are stored
once and paths refer to them by index (a shared prefix is one entry, not one per request).

Format: `MAGIC` + zlib(JSON). The zlib stream carries an Adler-32 of the JSON, so a torn or
flipped file fails to decode; the JSON is then checked field by field. Written like a page
(`sglang_hicache_ext.tiers.atomic_write`): temp file, fsync, rename, fsync of the folder. A file that fails any check
raises `HistoryFileError` for the caller to log, count and ignore (start from empty).
"""

from __future__ import annotations

import json
import math
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_hicache_ext.radix.groups import SubtreeGrouping
from sglang_hicache_ext.tiers.atomic_write import TEMP_SUFFIX, commit, fsync_directory, write_temp
from sglang_hicache_ext.tiers.pages.ttl_policy import TtlTable

MAGIC = b"sglang-hicache-ext ttl history\n"
FORMAT = "hicache_ext.ttl_history"
VERSION = 1

Request = tuple[float, tuple[str, ...]]


class HistoryFileError(Exception):
    """The history file is corrupt, truncated, or of a format this build does not read."""


@dataclass(frozen=True)
class SavedPlan:
    """The TTLs and grouping a plan published (restored until the next plan)."""

    at_s: float
    table: TtlTable
    grouping: SubtreeGrouping


@dataclass(frozen=True)
class TtlHistory:
    saved_at_s: float
    policy: str
    window_start_s: float  # the earliest time a plan may look back to
    bytes_per_page: int
    requests: tuple[Request, ...]  # oldest first
    plan: SavedPlan | None = None

    @property
    def page_accesses(self) -> int:
        return sum(len(path) for _, path in self.requests)


def save_history(path: Path, history: TtlHistory) -> int:
    """Write `history` crash-safely (old or new file after a crash, never a mix); its bytes.
    OS errors propagate."""
    data = encode_history(history)
    temp = write_temp(path, MAGIC, data, mtime=time.time())
    commit(temp, path)
    fsync_directory(path.parent)
    return len(MAGIC) + len(data)


def load_history(path: Path) -> TtlHistory | None:
    """The saved history, None when there is no file; `HistoryFileError` when it is unusable,
    OSError when it cannot be read."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    if not raw.startswith(MAGIC):
        raise HistoryFileError(f"{path}: not a TTL history file")
    try:
        document = json.loads(zlib.decompress(raw[len(MAGIC) :]))
    except (zlib.error, ValueError) as error:  # UnicodeDecodeError is a ValueError
        raise HistoryFileError(f"{path}: corrupt ({error})") from None
    try:
        return decode_history(document)
    except (KeyError, TypeError, ValueError, IndexError) as error:
        raise HistoryFileError(f"{path}: {type(error).__name__}: {error}") from None


def stray_temp_files(path: Path) -> list[Path]:
    """Temp files of interrupted saves of `path` (only safe to delete while owning the folder)."""
    return sorted(path.parent.glob(f".{path.name}.*{TEMP_SUFFIX}"))


def encode_history(history: TtlHistory) -> bytes:
    page_ids: dict[str, int] = {}
    requests = [
        [time_s, [page_ids.setdefault(page, len(page_ids)) for page in path]]
        for time_s, path in history.requests
    ]
    plan = history.plan
    document = {
        "format": FORMAT,
        "version": VERSION,
        "saved_at_s": history.saved_at_s,
        "policy": history.policy,
        "window_start_s": history.window_start_s,
        "bytes_per_page": history.bytes_per_page,
        "pages": list(page_ids),
        "requests": requests,
        "plan": None
        if plan is None
        else {
            "at_s": plan.at_s,
            "default_ttl_s": plan.table.default_ttl,
            "ttls": dict(plan.table.ttls),
            "spine": list(plan.grouping.spine),
            "top_subtrees": sorted(plan.grouping.top_subtrees),
        },
    }
    # allow_nan=False: a NaN time would load as a file we then refuse; fail on save instead.
    text = json.dumps(document, separators=(",", ":"), allow_nan=False)
    return zlib.compress(text.encode(), 6)


def decode_history(document: Any) -> TtlHistory:
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ValueError("not a TTL history document")
    if document.get("version") != VERSION:
        raise ValueError(f"version {document.get('version')!r}; this build reads {VERSION}")
    pages = _strings(document["pages"], "pages")
    requests: list[Request] = []
    previous = -math.inf
    for time_s, ids in document["requests"]:
        time_s = _finite(time_s, "request time")
        if time_s < previous:
            raise ValueError("requests are not in time order")
        previous = time_s
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and 0 <= i < len(pages) for i in ids
        ):
            raise ValueError("a request refers to an unknown page")
        requests.append((time_s, tuple(pages[i] for i in ids)))
    bytes_per_page = document["bytes_per_page"]
    if not isinstance(bytes_per_page, int) or bytes_per_page < 0:
        raise ValueError(f"bytes_per_page {bytes_per_page!r}")
    policy = document["policy"]
    if not isinstance(policy, str):
        raise ValueError(f"policy {policy!r}")
    return TtlHistory(
        saved_at_s=_finite(document["saved_at_s"], "saved_at_s"),
        policy=policy,
        window_start_s=_finite(document["window_start_s"], "window_start_s"),
        bytes_per_page=bytes_per_page,
        requests=tuple(requests),
        plan=_decode_plan(document["plan"]),
    )


def _decode_plan(plan: Any) -> SavedPlan | None:
    if plan is None:
        return None
    ttls = plan["ttls"]
    if not isinstance(ttls, dict):
        raise ValueError("plan TTLs are not a mapping")
    table = TtlTable(  # validates: finite, >= 0
        _finite(plan["default_ttl_s"], "default TTL"),
        {str(group): _finite(ttl, "TTL") for group, ttl in ttls.items()},
    )
    grouping = SubtreeGrouping(
        tuple(_strings(plan["spine"], "spine")),
        frozenset(_strings(plan["top_subtrees"], "top_subtrees")),
    )
    return SavedPlan(_finite(plan["at_s"], "plan time"), table, grouping)


def _finite(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} {value!r} is not a finite number")
    return float(value)


def _strings(values: Any, name: str) -> Sequence[str]:
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ValueError(f"{name} must be a list of strings")
    return values
