"""The disk tier's own counts on SGLang's Prometheus `/metrics` (`metrics/prometheus_metrics.py`).

Page reads and writes are counted where they happen (`storage_backend`). What the cores and the
other adapters count themselves (expiries in the disk store, plans in `OnlineTtl`, faults in
`fault_guard` and `history`) is exported from the backend's maintenance thread every
`purge_interval_s`: each tick adds what grew since the last one, so `/metrics` trails
`GET /hicache_ext/storage` by at most that interval. Nothing happens while SGLang's metrics are off.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

from sglang_hicache_ext.sglang_ext.metrics.prometheus_metrics import (
    CountMirror,
    ExtensionMetrics,
)
from sglang_hicache_ext.tiers.pages.page_store import PageStore
from sglang_hicache_ext.tuning.ttl.online import OnlineTtl

logger = logging.getLogger(__name__)

# The store's own fault counts (`GET /hicache_ext/storage` → `disk`), exported as error kinds.
STORE_ERROR_COUNTS = ("write_errors", "corrupt_pages", "io_errors")


class ExportedBackend(Protocol):
    store: PageStore
    online: OnlineTtl

    def error_counts(self) -> dict[str, Any]: ...


def error_kinds(errors: Mapping[str, Any], store_stats: Any) -> dict[str, int]:
    """One flat count per error kind: the backend's `errors` (entry-point exceptions as
    `exception.<entry point>`) and the store's fault counts."""
    kinds: dict[str, int] = {}
    for name, value in errors.items():
        if isinstance(value, Mapping):
            kinds.update({f"exception.{entry}": int(n) for entry, n in value.items()})
        else:
            kinds[name] = int(value)
    kinds.update({name: int(getattr(store_stats, name)) for name in STORE_ERROR_COUNTS})
    return kinds


class DiskTierMetricsExport:
    """Per backend: what was exported so far; `export` adds what grew since."""

    def __init__(self) -> None:
        self._errors = CountMirror()
        self._expired = CountMirror()
        self._plans = CountMirror()
        self._ttl_groups: set[str] = set()  # groups with a TTL gauge so far
        self._failed = False

    def export(self, backend: ExportedBackend, metrics: ExtensionMetrics | None) -> None:
        """Add what grew to `metrics` (None: SGLang's metrics are off, nothing to do). Never
        raises (runs in the maintenance thread): a failure is logged once."""
        if metrics is None:
            return
        try:
            stats = backend.store.stats()
            errors = error_kinds(backend.error_counts(), stats)
            for kind, grown in self._errors.changes(errors).items():
                metrics.storage_error(kind, grown)
            for group, grown in self._expired.changes(backend.store.expired_by_group()).items():
                metrics.disk_expired(group, grown)
            plans = self._plans.changes({"plans": backend.online.status()["plans"]})
            metrics.ttl_replans(plans.get("plans", 0))
            table = backend.online.policy.table
            # A group the new table no longer lists now lives at the default TTL.
            ttls = {group: table.ttl(group) for group in self._ttl_groups} | table.as_dict()
            self._ttl_groups |= set(ttls)
            metrics.ttl_seconds(ttls)
        except Exception:
            if not self._failed:
                logger.exception("hicache_ext: exporting disk tier metrics failed")
            self._failed = True
