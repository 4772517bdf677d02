"""The admin's calls: TTL re-plan, chunk list, storage status and page list, cache flush."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from benchmarks.soak.client import SoakClient
from benchmarks.soak.records import Outcome

STORAGE_SERIES_KEYS = (
    "entries",
    "used_bytes",
    "hits",
    "misses",
    "evicted",
    "expired",
    "corrupt_pages",
    "write_errors",
    "io_errors",
    "rejected_writes",
)


class StorageAdmin:
    """What the admin reads over the run: the chunk count and disk counters as time series, and
    named snapshots of the storage status (`before_fault`, `after_probes`, ..., `end`)."""

    def __init__(self, client: SoakClient, timeout_s: float, clock: Callable[[], float]) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self.clock = clock
        self.storage_series: list[dict[str, Any]] = []
        self.chunk_series: list[dict[str, Any]] = []
        self.snapshots: dict[str, dict[str, Any] | None] = {}

    def replan(self) -> Outcome:
        status, cls, body = self.client.call(
            "POST", "/hicache_ext/storage/ttl", self.timeout_s, json={"replan": True}
        )
        detail: dict[str, Any] = {}
        if cls == "2xx" and isinstance(body, dict):
            detail["replanned"] = body.get("replanned")
            plan = (body.get("ttl") or {}).get("last_plan") or {}
            detail["groups"] = plan.get("groups") if isinstance(plan, dict) else None
        return status, cls, detail

    def list_chunks(self) -> Outcome:
        status, cls, body = self.client.call("GET", "/chunks", self.timeout_s)
        detail: dict[str, Any] = {}
        if cls == "2xx" and isinstance(body, dict):
            chunks = body.get("chunks")
            detail["chunks"] = len(chunks) if isinstance(chunks, list | dict) else None
            self.chunk_series.append({"t": round(self.clock(), 1), **detail})
        return status, cls, detail

    def read_storage(self) -> Outcome:
        status, cls, body = self.client.call("GET", "/hicache_ext/storage", self.timeout_s)
        if cls == "2xx" and isinstance(body, dict):
            disk = body.get("disk") or {}
            self.storage_series.append(
                {"t": round(self.clock(), 1)} | {k: disk.get(k) for k in STORAGE_SERIES_KEYS}
            )
        return status, cls, {}

    def storage_status(self) -> dict[str, Any] | None:
        status, cls, body = self.client.call("GET", "/hicache_ext/storage", self.timeout_s)
        if cls != "2xx" or not isinstance(body, dict):
            return {"http_status": status, "class": cls}
        return {key: body.get(key) for key in ("root", "disk", "errors", "by_group")} | {
            "ttl_last_plan": (body.get("ttl") or {}).get("last_plan"),
            "hit_ratio": (body.get("ttl") or {}).get("hit_ratio"),
        }

    def snapshot(self, name: str) -> dict[str, Any] | None:
        """Keep the storage status under `name`; return it."""
        self.snapshots[name] = self.storage_status()
        return self.snapshots[name]

    def page_listing(self) -> list[dict[str, Any]]:
        _, cls, body = self.client.call(
            "GET", "/hicache_ext/storage", self.timeout_s, params={"pages": 100_000}
        )
        pages = body.get("pages") if cls == "2xx" and isinstance(body, dict) else None
        return [p for p in pages or [] if isinstance(p, dict)]

    def flush(self) -> bool:
        for _ in range(60):  # refused while requests are still running (aborts wind down)
            _, cls, _ = self.client.call("POST", "/flush_cache", self.timeout_s)
            if cls == "2xx":
                return True
            time.sleep(1.0)
        return False
