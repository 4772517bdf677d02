"""What the soak prints: progress lines (above the progress bar) and the final summary."""

from __future__ import annotations

import json
import sys
from typing import Any

from tqdm import tqdm

from benchmarks.soak.records import STATUS_CLASSES


def say(message: str) -> None:
    """One line on stdout, above a progress bar if one is shown, flushed (logs follow the run)."""
    tqdm.write(message)
    sys.stdout.flush()


def print_summary(report: dict[str, Any]) -> None:
    req = report["requests"]
    print(
        f"\n{'kind':<18}"
        + "".join(f"{c:>13}" for c in STATUS_CLASSES)
        + f"{'p50 s':>9}{'p99 s':>9}"
    )
    for kind, counts in req["by_kind"].items():
        lat = report["latency"]["overall"][kind]
        print(
            f"{kind:<18}"
            + "".join(f"{counts.get(c, 0):>13}" for c in STATUS_CLASSES)
            + f"{lat.get('p50_s', float('nan')):>9.2f}{lat.get('p99_s', float('nan')):>9.2f}"
        )
    print(f"total {req['total']} requests: {req['by_class']}")
    if report["fusion"]:
        print("fusion:", {k: v for k, v in report["fusion"].items()})
    growth = report["rss"]["growth"]
    if "growth_median" in growth:
        print(
            f"RSS: window start {growth['bytes_at_window_start'] / 2**20:.0f} MiB, end "
            f"{growth['bytes_at_end'] / 2**20:.0f} MiB (point-to-point {growth['growth']:+.2%}); "
            f"medians {growth['median_first_edge_bytes'] / 2**20:.0f} -> "
            f"{growth['median_last_edge_bytes'] / 2**20:.0f} MiB ({growth['growth_median']:+.2%}) "
            f"over the last {growth['window_s'] / 60:.1f} min"
        )
    else:
        print(f"RSS: {growth.get('error')}")
    storage = report["storage"]
    print(
        f"disk tier corrupt_pages before fault / at the end: {storage['corrupt_pages_before']} "
        f"-> {storage['corrupt_pages_after']}"
    )
    wanted = ("corrupt_pages", "io_errors", "read_failures", "misses", "exceptions")
    changed = {
        k: v for k, v in storage["changed_by_fault_probes"].items() if any(w in k for w in wanted)
    }
    print(f"changed by the fault and its probes: {changed}")
    if report["crash"]:
        print(f"CRASH at {report['crash']['t']:.1f}s: {report['crash']['reason']}")
        print(report["crash"]["log_tail"])
    for failure in req["first_failures"][:10]:
        print("failure:", failure)
    print("\nacceptance:")
    for name, item in report["acceptance"].items():
        if name != "pass":
            values = json.dumps({k: v for k, v in item.items() if k != "pass"})
            print(f"  {name:<14} {'pass' if item['pass'] else 'FAIL'}  {values}")
    print(f"  => {'PASS' if report['acceptance']['pass'] else 'FAIL'}")
