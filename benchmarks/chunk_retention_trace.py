"""What compressing before dropping adds to admission under pressure, on the traces of
`chunk_admission_trace` (same mixes, budgets, warm-up and metric: tokens of pieces found stored
/ tokens of pieces seen before).

Arms, all with the default admission (`chunk_admission: "adaptive"`):
- `lru`: `chunk_retention: "lru"`, host memory drops the least recently used (before this
  change, the only eviction);
- `utility`: `chunk_retention: "utility"` (the default now), the shipped `UtilityRetention`
  with its default floor: a chunk is compressed a step (dense -> int8) or dropped, whichever
  loses least; int4 stays refused by the floor. A piece's KV is `--kv-bytes-per-token` (an 8B
  model's bf16 KV: 128 KiB a token); int8 keeps `PRIOR_SIZE_RATIO` of it (bf16 rows: 0.53);
- `belady`: offline, every piece dense (the reference of `chunk_admission_trace`);
- `belady_int8`: offline with every piece int8 (the budget over the int8 ratio): what a policy
  that compresses every piece could at best keep.

    python -m benchmarks.chunk_retention_trace   # benchmarks/results/chunk_retention_trace.json, .png
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.chunk_admission_trace import RESULTS, SKETCH_ENTRIES
from benchmarks.piece_traces import (
    Trace,
    label_mixes,
    redo_saved_report,
    reusable_tokens,
    run_belady,
    trace_arguments,
    write_trace_report,
)
from benchmarks.run_figures import save_run_figure
from benchmarks.smollm2_server import report_header
from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings
from sglang_hicache_ext.tiers.chunks.admission import FrequencyAdmission
from sglang_hicache_ext.tiers.chunks.host_cache import HostCacheFullError, HostChunkCache
from sglang_hicache_ext.tiers.chunks.retention import (
    PRIOR_SIZE_RATIO,
    PRIOR_STEP_ERROR,
    UtilityRetention,
)
from sglang_hicache_ext.tuning.sim.fused_serving import Load

MAX_ERROR = ExtensionSettings.model_fields["chunk_retention_max_kv_error"].default
ARMS = ("lru", "utility")


@dataclass(frozen=True)
class Stored:
    tokens: int
    nbytes: int
    form: str = "none"


class StoredForms:
    """`ChunkForms` of a trace's pieces: a compression keeps the learned size ratio and adds
    the prior error of its step (what the measured codecs do to SmolLM2's KV)."""

    def __init__(self, disk: HostChunkCache[Stored] | None) -> None:
        self._disk = disk

    def form(self, value: Stored) -> str:
        return value.form

    def tokens(self, value: Stored) -> int:
        return value.tokens

    def nbytes(self, value: Stored) -> int:
        return value.nbytes

    def below(self, key: str) -> bool:
        return self._disk is not None and key in self._disk

    def compress(self, key: str, value: Stored, to: str) -> tuple[Stored, float]:
        return Stored(value.tokens, int(value.nbytes * PRIOR_SIZE_RATIO[to]), to), PRIOR_STEP_ERROR[
            to
        ]


def run_arm(
    trace: Trace,
    sizes: dict[str, int],
    host_budget: int,
    disk_budget: int,
    start: int,
    arm: str,
    kv_bytes: int,
    loads: list[list[Load]] | None = None,
) -> tuple[int, dict[str, int]]:
    """Reused tokens after `start`, and host memory's counts, under the default admission and
    `chunk_retention: <arm>` (budgets in tokens, as `chunk_admission_trace.run_policy`'s).
    With `loads`, each request's reused pieces after `start` are appended to it: tokens, the
    bytes read in the form stored, and the tier read from."""
    admission = FrequencyAdmission.for_entries(
        SKETCH_ENTRIES, host_budget * kv_bytes, disk_budget * kv_bytes or None
    )
    disk: HostChunkCache[Stored] | None = (
        HostChunkCache(disk_budget * kv_bytes) if disk_budget else None
    )
    retention: UtilityRetention[Stored] | None = None
    if arm == "utility":
        retention = UtilityRetention(MAX_ERROR, admission=admission)
        retention.bind(StoredForms(disk))
    host: HostChunkCache[Stored] = HostChunkCache(host_budget * kv_bytes, admission, retention)
    reused = 0
    for index, pieces in enumerate(trace):
        admission.record_prompt([(key, sizes[key] * kv_bytes) for key in pieces])
        read: list[Load] = []
        if loads is not None and index >= start:
            loads.append(read)
        for key in pieces:
            piece = Stored(sizes[key], sizes[key] * kv_bytes)
            counted = sizes[key] if index >= start else 0
            if (held := host.get(key)) is not None:
                reused += counted
                read.append(Load(sizes[key], held.nbytes, "host"))
                continue
            if disk is not None and (kept := disk.get(key)) is not None:
                reused += counted
                read.append(Load(sizes[key], kept.nbytes, "disk"))
                with contextlib.suppress(HostCacheFullError):
                    host.put(key, piece)  # promoted without admission, as ChunkTiers.pin does
                continue
            try:
                host.put(key, piece, by_frequency=True)
            except HostCacheFullError:
                continue
            if disk is not None:
                with contextlib.suppress(HostCacheFullError):
                    disk.put(key, piece)
    stats = host.stats()
    counts = {"evictions": stats.evictions, "compressed_to_int8": stats.compressed_to_int8}
    return reused, counts


def measure(
    trace: Trace,
    sizes: dict[str, int],
    reference_tokens: int,
    budget: float,
    disk: float,
    kv_bytes: int,
) -> dict[str, Any]:
    start = len(trace) // 5
    host_budget, disk_budget = int(budget * reference_tokens), int(disk * reference_tokens)
    reusable = reusable_tokens(trace, sizes, start)
    row: dict[str, Any] = {}
    for arm in ARMS:
        reused, counts = run_arm(trace, sizes, host_budget, disk_budget, start, arm, kv_bytes)
        row[arm] = round(reused / reusable, 4)
        row[f"{arm}_counts"] = counts
    belady = run_belady(trace, sizes, host_budget + disk_budget, start)
    int8_budget = int(host_budget / PRIOR_SIZE_RATIO["int8"]) + disk_budget
    belady_int8 = run_belady(trace, sizes, int8_budget, start)
    row["belady"] = round(belady / reusable, 4)
    row["belady_int8"] = round(belady_int8 / reusable, 4)
    for arm in ARMS:
        row[f"{arm}_of_belady"] = round(row[arm] / row["belady"], 4) if row["belady"] else None
    row["utility_over_lru"] = round(row["utility"] / row["lru"], 4) if row["lru"] else None
    return row


def summarise(report: dict[str, Any]) -> None:
    """The ranges the docs quote, per trace and with or without a disk tier below:
    utility / LRU and utility / Belady (dense)."""
    for name in ("synthetic", "mooncake"):
        for tier, with_disk in (("host", False), ("disk", True)):
            found = [
                r for r in report.get(name, {}).get("rows", []) if bool(r["disk"]) == with_disk
            ]
            if not found:
                continue
            over_lru = [r["utility_over_lru"] for r in found if r["utility_over_lru"] is not None]
            of_belady = [
                r["utility_of_belady"] for r in found if r["utility_of_belady"] is not None
            ]
            report[f"min_utility_over_lru_{tier}_{name}"] = min(over_lru)
            report[f"max_utility_over_lru_{tier}_{name}"] = max(over_lru)
            report[f"min_utility_of_belady_{tier}_{name}"] = min(of_belady)
            report[f"max_utility_of_belady_{tier}_{name}"] = max(of_belady)
    if "synthetic" in report:
        rows = report["synthetic"]["rows"]
        report["synthetic"]["host_only_mixes"] = sum(1 for r in rows if not r["disk"])


def plot(report: dict[str, Any], out: Path) -> Path:
    """Reused tokens per arm as a share of Belady's (dense pieces): every synthetic mix, sorted
    by LRU's share, and the Mooncake trace's budgets."""
    import matplotlib.pyplot as plt

    sets = [name for name in ("synthetic", "mooncake") if name in report]
    figure, axes = plt.subplots(1, len(sets), figsize=(5.5 * len(sets), 4), squeeze=False)
    for axis, name in zip(axes[0], sets, strict=True):
        rows = sorted(report[name]["rows"], key=lambda row: row["lru_of_belady"])
        for colour, arm in enumerate(ARMS):
            shares = [row[f"{arm}_of_belady"] for row in rows]
            axis.plot(shares, "o-", color=f"C{colour}", label=f"retention: {arm}")
        best = [row["belady_int8"] / row["belady"] for row in rows]
        axis.plot(best, ":", color="grey", label="Belady, every piece int8")
        axis.axhline(0.9, linestyle="--", color="lightgrey")
        label_mixes(axis, rows, ylabel="reused tokens / Belady's (dense)", title=name)
    return save_run_figure(figure, report, out)


def main() -> None:
    parser = trace_arguments(__doc__.split("\n")[0], "0.25,0.5", "0.1,0.25")
    parser.add_argument("--kv-bytes-per-token", type=int, default=128 * 1024)
    parser.add_argument("--out", type=Path, default=RESULTS / "chunk_retention_trace.json")
    parser.add_argument("--summary-only", action="store_true", help="redo --out's summary")
    args = parser.parse_args()
    if redo_saved_report(args, plot, summarise):
        return
    kv = args.kv_bytes_per_token
    report: dict[str, Any] = {
        **report_header("benchmarks.chunk_retention_trace"),  # the commit it starts at
        "kv_bytes_per_token": kv,
        "max_kv_error": MAX_ERROR,
        "int8_size_ratio": PRIOR_SIZE_RATIO["int8"],
        "metric": "tokens of pieces found stored / tokens of pieces seen before, after the "
        "first fifth of the requests",
    }
    write_trace_report(report, args, lambda *mix: measure(*mix, kv), summarise, plot)


if __name__ == "__main__":
    main()
