"""The run's report: requests by kind and class, latency percentiles, RSS growth, storage
counters around the fault, and the acceptance verdict."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from typing import Any

from benchmarks.soak.records import FAILURE_CLASSES, Record
from benchmarks.soak.run import Soak
from benchmarks.soak.server_process import scan_log
from benchmarks.soak.soak_options import SoakOptions
from benchmarks.soak.workload import SELECTORS, WEIGHTS
from sglang_hicache_ext.evaluation.model_paths import SMOLLM2
from sglang_hicache_ext.sglang_ext.server.launcher import ServerConfig

CONFIG_ARGS = (
    "workers",
    "request_timeout_s",
    "admin_timeout_s",
    "replan_every_s",
    "read_every_s",
    "sample_s",
    "fault_at",
    "corrupt_pages",
    "seed",
)


def percentiles(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"n": 0}
    ordered = sorted(values)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {
        "n": len(ordered),
        "p50_s": pct(0.5),
        "p90_s": pct(0.9),
        "p99_s": pct(0.99),
        "max_s": ordered[-1],
    }


def rss_growth(
    samples: list[tuple[float, int]], duration_s: float, held: tuple[float, float] | None = None
) -> dict[str, Any]:
    """Growth over the last min(10 min, half) of the run: point-to-point (the sample at the
    window start to the last one) and median-based (the median of the last `edge_s` over the
    median of the first `edge_s`, without the samples taken while the fault held the traffic)."""
    window_s = min(600.0, duration_s / 2)
    start = duration_s - window_s
    inside = [(t, b) for t, b in samples if start <= t <= duration_s + 1]
    edge_s = min(60.0, window_s / 3)
    report: dict[str, Any] = {"window_s": window_s, "window_start_s": start, "edge_s": edge_s}
    if len(inside) < 4:
        report["error"] = f"only {len(inside)} RSS samples in the window"
        return report
    first, last = inside[0][1], inside[-1][1]
    loaded = [(t, b) for t, b in inside if held is None or not held[0] <= t <= held[1]]
    head = [b for t, b in loaded if t <= loaded[0][0] + edge_s]
    tail = [b for t, b in loaded if t >= loaded[-1][0] - edge_s]
    report.update(
        bytes_at_window_start=first,
        bytes_at_end=last,
        growth=(last - first) / first,
        median_first_edge_bytes=statistics.median(head),
        median_last_edge_bytes=statistics.median(tail),
        growth_median=(statistics.median(tail) - statistics.median(head)) / statistics.median(head),
        max_bytes_in_window=max(b for _, b in inside),
    )
    return report


def flat_counters(status: dict[str, Any] | None) -> dict[str, float]:
    """The numeric counters of a storage status (`disk` and `errors`), flattened."""
    out: dict[str, float] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[prefix] = value

    for section in ("disk", "errors"):
        walk(section, (status or {}).get(section))
    return out


def counter_changes(
    before: dict[str, Any] | None, after: dict[str, Any] | None
) -> dict[str, list[float]]:
    """Counters that differ: name -> [before, after]."""
    old, new = flat_counters(before), flat_counters(after)
    return {k: [old.get(k), new[k]] for k in sorted(new) if old.get(k) != new[k]}


def latency_windows(records: list[Record], window_s: float) -> list[dict[str, Any]]:
    """Latency percentiles per kind in consecutive windows of `window_s`."""
    windows = []
    t0 = 0.0
    while t0 < max((r.t for r in records), default=0.0) + 1e-9:
        inside = [r for r in records if t0 <= r.t < t0 + window_s]
        kinds = sorted({r.kind for r in inside})
        windows.append(
            {
                "t0_s": t0,
                "t1_s": t0 + window_s,
                "requests": len(inside),
                "latency": {
                    k: percentiles([r.latency_s for r in inside if r.kind == k]) for k in kinds
                },
            }
        )
        t0 += window_s
    return windows


def acceptance(
    crashes: int, growth: dict[str, Any], failures: dict[str, int], max_rss_growth: float
) -> dict[str, Any]:
    rss_ok = "growth_median" in growth and growth["growth_median"] < max_rss_growth
    verdict: dict[str, Any] = {
        "crashes": {"value": crashes, "pass": crashes == 0},
        "rss_growth": {
            "value": growth.get("growth_median"),
            "point_to_point": growth.get("growth"),
            "limit": max_rss_growth,
            "window_s": growth["window_s"],
            "pass": bool(rss_ok),
        },
        "clear_status": {"failures": failures, "pass": sum(failures.values()) == 0},
    }
    verdict["pass"] = all(v["pass"] for v in verdict.values())
    return verdict


def storage_report(soak: Soak) -> dict[str, Any]:
    snapshots = soak.admin.snapshots
    before = snapshots.get("before_fault") or {}
    probes = snapshots.get("after_probes") or {}
    after = snapshots.get("end") or snapshots.get("after_fault_60s") or probes
    return {
        "before_fault": before,
        "after_fault_60s": snapshots.get("after_fault_60s"),
        "end": snapshots.get("end"),
        "after_fault_probes": probes or None,
        "corrupt_pages_before": (before.get("disk") or {}).get("corrupt_pages"),
        "corrupt_pages_after": (after.get("disk") or {}).get("corrupt_pages"),
        "errors_before": before.get("errors"),
        "errors_after": after.get("errors"),
        "changed_by_fault_probes": counter_changes(before, probes),
        "changed_before_fault_to_end": counter_changes(before, after),
        "series": soak.admin.storage_series,
    }


def summarise(
    soak: Soak, args: SoakOptions, config: ServerConfig, extra: dict[str, Any]
) -> dict[str, Any]:
    records = soak.recorder.snapshot()
    monitor, traffic, fault = soak.monitor, soak.traffic, soak.fault.record
    duration = soak.duration_s
    by_kind: dict[str, Counter[str]] = defaultdict(Counter)
    codes: dict[str, Counter[str]] = defaultdict(Counter)
    for r in records:
        by_kind[r.kind][r.cls] += 1
        codes[r.kind][str(r.status)] += 1
    totals = Counter(r.cls for r in records)
    window_s = max(30.0, duration / 10)
    samples = [(t, b) for t, b, _ in monitor.rss_samples]
    held = (fault["t"], fault["t"] + fault["held_s"]) if "held_s" in fault else None
    growth = rss_growth(samples, duration, held)
    failures = {c: totals.get(c, 0) for c in FAILURE_CLASSES}
    failing = [
        {"t": round(r.t, 2), "kind": r.kind, "status": r.status, "class": r.cls, **r.detail}
        for r in records
        if r.cls in FAILURE_CLASSES
    ][:50]
    crashes = 1 if monitor.crash else 0
    last_rss = monitor.rss_samples[-1][2] if monitor.rss_samples else {}
    return {
        "benchmark": "soak",
        "model": SMOLLM2,
        "started_at": extra["started_at"],
        "config": {
            "server_command": config.command()[1:],
            "disk_tier": extra["disk_extra"],
            "weights": WEIGHTS,
            "selectors": dict(SELECTORS),
        }
        | {name: getattr(args, name) for name in CONFIG_ARGS},
        "duration_s": duration,
        "traffic_s": soak.traffic_end_s if monitor.crash is None else monitor.crash["t"],
        "requests": {
            "total": len(records),
            "by_class": dict(totals),
            "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
            "http_status_by_kind": {k: dict(v) for k, v in sorted(codes.items())},
            "first_failures": failing,
        },
        "fusion": {k: dict(v) for k, v in sorted(traffic.fusion.items())},
        "cached_tokens": {k: dict(v) for k, v in sorted(traffic.cached_tokens.items())},
        "normal_output_checks": {
            "note": "same prompt, greedy: later outputs vs the first (informative; batches differ)",
            **{k: dict(v) for k, v in traffic.output_checks.items()},
        },
        "bad_requests": {k: dict(v) for k, v in sorted(traffic.bad_cases.items())},
        "crashes": crashes,
        "crash": monitor.crash,
        "health_failures": monitor.health_failures,
        "rss": {
            "samples": [[round(t, 2), b] for t, b in samples],
            "processes": {str(pid): name for pid, name in monitor.proc_names.items()},
            "last_sample_by_pid": {str(k): v for k, v in last_rss.items()},
            "growth": growth,
        },
        "latency": {
            "overall": {
                k: percentiles([r.latency_s for r in records if r.kind == k])
                for k in sorted(by_kind)
            },
            "window_s": window_s,
            "windows": latency_windows(records, window_s),
        },
        "fault": fault,
        "storage": storage_report(soak),
        "chunks_series": soak.admin.chunk_series,
        "server_log": {"path": str(monitor.log_path), **scan_log(monitor.log_path)},
        "acceptance": acceptance(crashes, growth, failures, args.max_rss_growth),
        "records": [
            [round(r.t, 2), r.kind, r.status, r.cls, round(r.latency_s, 3)] for r in records
        ],
    }
