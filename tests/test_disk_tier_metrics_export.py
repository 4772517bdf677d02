"""The disk tier's own counts as Prometheus series, off the server: a real backend (disk store,
TTL planner, fault counts) exported into the extension's series on a private registry.

Reads and writes are counted at their call sites and checked end to end in
tests/test_server_metrics.py; expiries, plans, TTLs and faults are exported by the maintenance
thread, which this test drives by hand.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sglang_hicache_ext.sglang_ext.metrics.prometheus_metrics import ExtensionMetrics
from tests.test_storage_backend_faults import PAGE_SIZE, open_backend

LABELS = {"model_name": "org/tiny", "tp_rank": "0"}


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k not in LABELS))): (
            sample.value
        )
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


def test_expiries_errors_plans_and_ttls_are_exported_once(tmp_path: Path) -> None:
    # Purges only by hand (the maintenance thread would export into no series here anyway).
    backend = open_backend(tmp_path / "disk", initial_ttl_s=0.2, purge_interval_s=3600)
    try:
        keys = [f"page-{i}" for i in range(3)]
        indices = torch.arange(len(keys) * PAGE_SIZE)
        # No write info from a controller: groups derived and counted (`writes_without_groups`).
        assert backend.batch_set_v1(keys, indices) == [True] * 3
        time.sleep(0.3)
        assert backend.store.purge_expired() == 3
        assert backend.store.expired_by_group() == {"residual": 3}

        registry = CollectorRegistry()
        metrics = ExtensionMetrics(LABELS, registry=registry)
        backend.metrics_export.export(backend, metrics)
        backend.metrics_export.export(backend, metrics)  # nothing grew: nothing added
        series = samples(registry)
        for _ in range(2):
            backend.online.record(keys)
        plan = backend.online.replan()
        assert plan is not None
        backend.metrics_export.export(backend, metrics)
        planned = samples(registry)
    finally:
        backend.close()

    prefix = "sglang:hicache_ext_"
    assert series[(prefix + "disk_expired_pages_total", (("group", "residual"),))] == 3
    errors = {
        dict(labels)["kind"]: value
        for (name, labels), value in series.items()
        if name == prefix + "storage_errors_total" and value
    }
    assert errors == {"writes_without_groups": 1}
    assert series[(prefix + "ttl_seconds", (("group", "default"),))] == 0.2
    assert series[(prefix + "ttl_replans_total", ())] == 0
    assert planned[(prefix + "ttl_replans_total", ())] == 1
    for group, ttl in plan.ttls.items():
        assert planned[(prefix + "ttl_seconds", (("group", group),))] == ttl
