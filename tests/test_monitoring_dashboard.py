"""The Grafana dashboard of `examples/monitoring/` queries only series that exist: ours (an
`ExtensionMetrics`, the fused TTFT histogram and the shadow checks' series on a private
registry) and SGLang's own (the
names its metrics collector registers, read from the installed SGLang)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from sglang_hicache_ext.sglang_ext.metrics.http_process_metrics import (
    FusedTtftMetrics,
    ShadowCheckMetrics,
)
from sglang_hicache_ext.sglang_ext.metrics.prometheus_metrics import ExtensionMetrics

DASHBOARD = Path(__file__).resolve().parents[1] / "examples/monitoring/grafana_hicache_ext.json"
LABELS = {"model_name": "m", "tp_rank": "0"}


def _queried() -> set[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [target["expr"] for panel in panels for target in panel["targets"]]
    names = {name for expr in exprs for name in re.findall(r"sglang:[a-z_]+", expr)}
    return {re.sub(r"_(bucket|count|sum)$", "", name) for name in names}


def _ours() -> set[str]:
    registry = CollectorRegistry()
    ExtensionMetrics(LABELS, registry=registry)
    FusedTtftMetrics({"model_name": "m"}, registry=registry)
    ShadowCheckMetrics({"model_name": "m"}, registry=registry)
    names = set()
    for family in registry.collect():
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    # Counters are families without `_total`; a labelled series has no sample until used.
    return names | {f"{name}_total" for name in names}


def _sglangs() -> set[str]:
    # Read, not imported: importing SGLang's collector loads all of SGLang.
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin is not None
    collector = Path(spec.origin).parent / "srt/observability/metrics_collector.py"
    return set(re.findall(r'name="(sglang:[a-z_]+)"', collector.read_text()))


def test_every_series_the_dashboard_queries_exists() -> None:
    queried = _queried()
    assert any(name.startswith("sglang:hicache_ext_") for name in queried)
    missing = queried - _ours() - _sglangs()
    assert not missing, f"the dashboard queries series nobody exports: {sorted(missing)}"


def test_every_panel_has_a_title_a_query_and_a_place() -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    for panel in panels:
        assert panel["title"] and panel["targets"] and panel["gridPos"]["w"] > 0
