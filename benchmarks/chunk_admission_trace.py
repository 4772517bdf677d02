"""How much of the reusable chunk tokens host memory keeps under pressure, by admission policy.

Traces of requests, each a list of document pieces (the pieces `auto_chunks` keeps;
`piece_traces.py`): synthetic (`--per-request` pieces a request, a share `--one-offs` seen once
only, the rest from `--popular` documents with Zipf popularity `--skews`) and the Mooncake
conversation trace mapped to documents (each 512-token block a piece).

Per policy and host budget (`--budgets`, times the popular set's tokens; for the Mooncake trace
times the tokens of the blocks seen more than once), over the requests after the first fifth
(warm-up): tokens of pieces found stored / tokens of pieces seen before, which is what any policy
could at best reuse. The policies run the shipped code: `HostChunkCache` with and without its
`FrequencyAdmission` (sized by the settings' default), every sight recorded as the server's
`AutoCapture` records it, every missed piece offered as it offers one; host memory drops the
least recently used (`chunk_retention: "lru"`; `chunk_retention_trace.py` weighs retention by
utility under the default admission).

- `lru`: `chunk_admission: "lru"`, every missed piece stored, the least recently used evicted;
- `frequency`: `chunk_admission: "frequency"`, TinyLFU alone;
- `adaptive`: `chunk_admission: "adaptive"` (the default), frequency or recency, whichever of
  the two key-only shadows of host memory would have served more;
- `belady`: offline, with the future known (`piece_traces.run_belady`).

With `--disk-budget X` a disk tier below host memory of X times the same set: every piece host
memory takes is also written to disk (write-through), the disk evicts by recency, and a piece
found only on disk is reused (read back, promoted to host memory as the server promotes: without
admission). Belady then holds host + disk budget as one.

    python -m benchmarks.chunk_admission_trace   # benchmarks/results/chunk_admission_trace.json, .png
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.piece_traces import (
    Trace,
    floats,
    mooncake_trace,
    reusable_tokens,
    reused_set_tokens,
    run_belady,
    synthetic_mixes,
    synthetic_trace,
    trace_arguments,
)
from benchmarks.shared_data import CONVERSATION_TRACE
from benchmarks.smollm2_server import write_json
from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings
from sglang_hicache_ext.tiers.chunks.admission import FrequencyAdmission
from sglang_hicache_ext.tiers.chunks.host_cache import HostCacheFullError, HostChunkCache

RESULTS = Path(__file__).resolve().parent / "results"
SKETCH_ENTRIES = ExtensionSettings.model_fields["chunk_admission_sketch_entries"].default
POLICIES = ("lru", "frequency", "adaptive")  # the values of the setting chunk_admission


@dataclass(frozen=True)
class Piece:
    nbytes: int  # tokens here: the budgets are in tokens


def run_policy(
    trace: Trace,
    sizes: dict[str, int],
    host_budget: int,
    disk_budget: int,
    start: int,
    policy: str,
    restart_at: int | None = None,
    keep_state: bool = False,
) -> int:
    """Reused tokens after `start` with the shipped host cache (and a disk tier's budget) under
    `chunk_admission: <policy>`. With `restart_at`, the server restarts before that request:
    host memory starts empty, the disk tier keeps what it held, and the admission's state is
    kept (`keep_state`) or starts empty, as it does today."""

    def fresh_admission() -> FrequencyAdmission | None:
        if policy == "lru":
            return None
        if policy == "frequency":
            return FrequencyAdmission.for_entries(SKETCH_ENTRIES)
        return FrequencyAdmission.for_entries(SKETCH_ENTRIES, host_budget, disk_budget or None)

    admission = fresh_admission()
    host: HostChunkCache[Piece] = HostChunkCache(host_budget, admission)
    disk: HostChunkCache[Piece] | None = HostChunkCache(disk_budget) if disk_budget else None
    reused = 0
    for index, pieces in enumerate(trace):
        if index == restart_at:
            admission = admission if keep_state else fresh_admission()
            host = HostChunkCache(host_budget, admission)
        if admission is not None:  # AutoCapture records a prompt's sights before judging any
            admission.record_prompt([(key, sizes[key]) for key in pieces])
        for key in pieces:
            piece = Piece(sizes[key])
            if host.get(key) is not None:
                reused += piece.nbytes if index >= start else 0
                continue
            if disk is not None and disk.get(key) is not None:
                reused += piece.nbytes if index >= start else 0
                # Promoted as ChunkTiers.pin promotes: no admission for a chunk being read.
                with contextlib.suppress(HostCacheFullError):
                    host.put(key, piece)
                continue
            try:
                host.put(key, piece, by_frequency=True)
            except HostCacheFullError:  # NotAdmittedError, or larger than host memory
                continue
            if disk is not None:  # write-through of what host memory took
                with contextlib.suppress(HostCacheFullError):
                    disk.put(key, piece)
    return reused


def measure(
    trace: Trace, sizes: dict[str, int], reference_tokens: int, budget: float, disk: float
) -> dict[str, float]:
    start = len(trace) // 5
    host_budget = int(budget * reference_tokens)
    disk_budget = int(disk * reference_tokens)
    reusable = reusable_tokens(trace, sizes, start)
    row = {
        policy: run_policy(trace, sizes, host_budget, disk_budget, start, policy)
        for policy in POLICIES
    }
    row["belady"] = run_belady(trace, sizes, host_budget + disk_budget, start)
    shares = {name: value / reusable for name, value in row.items()}
    for policy in POLICIES:
        shares[f"{policy}_of_belady"] = row[policy] / row["belady"]
    return shares


def plot(report: dict[str, Any], out: Path) -> Path:
    """Each policy's reused tokens as a share of Belady's: every synthetic mix (sorted by LRU's
    share), and the Mooncake trace by host budget."""
    import matplotlib.pyplot as plt

    figure, (synthetic, mooncake) = plt.subplots(1, 2, figsize=(11, 4))
    rows = sorted(report["synthetic"]["rows"], key=lambda row: row["lru_of_belady"])
    for colour, policy in enumerate(POLICIES):
        synthetic.plot(
            [row[f"{policy}_of_belady"] for row in rows], ".-", color=f"C{colour}", label=policy
        )
    synthetic.axhline(0.9, linestyle="--", color="grey")
    synthetic.set(
        xlabel="mix (skew x one-off share x host budget x disk), by LRU's share",
        ylabel="reused tokens / Belady's",
        title=f"Synthetic, {len(rows)} mixes",
        ylim=(0, 1.05),
    )
    synthetic.legend()
    for disk in sorted({row["disk"] > 0 for row in report["mooncake"]["rows"]}):
        chosen = [row for row in report["mooncake"]["rows"] if (row["disk"] > 0) == disk]
        for colour, policy in enumerate(POLICIES):
            mooncake.plot(
                [row["budget"] for row in chosen],
                [row[f"{policy}_of_belady"] for row in chosen],
                "o-" if not disk else "x:",
                color=f"C{colour}",
                label=f"{policy}, disk {chosen[0]['disk'] / chosen[0]['budget']:g}x host"
                if disk
                else policy,
            )
    mooncake.set(
        xscale="log",
        xlabel="host budget / tokens of blocks seen twice or more",
        ylabel="reused tokens / Belady's",
        title="Mooncake conversation trace, 512-token blocks",
        ylim=(0, 1.05),
    )
    mooncake.legend(fontsize=7)
    figure.suptitle(report["command"], fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)
    return out


def restart_cost(
    trace: Trace, sizes: dict[str, int], reference_tokens: int, budget: float, disk: float
) -> dict[str, float]:
    """Reused tokens of the second half, as a share of the reusable, when the server restarts at
    the half with the adaptive admission's state kept or rebuilt from traffic (today), against
    no restart."""
    half = len(trace) // 2
    host_budget, disk_budget = int(budget * reference_tokens), int(disk * reference_tokens)
    reusable = reusable_tokens(trace, sizes, half)
    runs = {
        "no_restart": {},
        "state_kept": {"restart_at": half, "keep_state": True},
        "state_rebuilt": {"restart_at": half, "keep_state": False},
    }
    return {
        name: round(
            run_policy(trace, sizes, host_budget, disk_budget, half, "adaptive", **kwargs)
            / reusable,
            4,
        )
        for name, kwargs in runs.items()
    }


def main() -> None:
    parser = trace_arguments(__doc__.split("\n")[0], "1.0,1.5,2.0", "0.1,0.25,0.5,1.0")
    parser.add_argument(
        "--restart-mix", default="1.0,0.8,1.5", help="skew,one-off,budget of the restart rows"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "chunk_admission_trace.json")
    args = parser.parse_args()
    if args.plot_only:
        print(plot(json.loads(args.out.read_text()), args.out.with_suffix(".png")))
        return

    rows: list[dict[str, Any]] = []
    disks = [0.0, args.disk_budget] if args.disk_budget else [0.0]
    for mix in synthetic_mixes(args):
        shares = measure(mix.trace, mix.sizes, mix.popular_tokens, mix.budget, mix.disk)
        rows.append(mix.key() | {name: round(value, 4) for name, value in shares.items()})
        print(json.dumps(rows[-1]))
    restarts: list[dict[str, Any]] = []
    if args.restart_mix:
        skew, one_off, budget = floats(args.restart_mix)
        trace, sizes = synthetic_trace(
            args.requests, args.per_request, args.popular, skew, one_off, args.seed
        )
        popular_tokens = sum(sizes[f"doc{i}"] for i in range(args.popular))
        for disk in disks:
            restarts.append(
                {"skew": skew, "one_off": one_off, "budget": budget, "disk": disk}
                | restart_cost(trace, sizes, popular_tokens, budget, disk)
            )
            print(json.dumps(restarts[-1]))
    path = args.trace or CONVERSATION_TRACE
    trace, sizes = mooncake_trace(path, args.trace_requests)
    reused_set = reused_set_tokens(trace, sizes)
    mooncake_rows: list[dict[str, Any]] = []
    for budget in floats(args.trace_budgets):
        for disk in disks:
            shares = measure(trace, sizes, reused_set, budget, disk * budget)
            mooncake_rows.append(
                {"budget": budget, "disk": disk * budget}
                | {name: round(value, 4) for name, value in shares.items()}
            )
            print(json.dumps(mooncake_rows[-1]))
    report = {
        "command": "python -m benchmarks.chunk_admission_trace " + " ".join(sys.argv[1:]),
        "sketch_entries": SKETCH_ENTRIES,
        "metric": "reused tokens / tokens of pieces seen before, after the first fifth",
        "synthetic": {
            "requests": args.requests,
            "popular": args.popular,
            "per_request": args.per_request,
            "mixes": len(rows),
            "rows": rows,
        },
        # Second half's reuse after a restart at the half (adaptive), state kept or rebuilt.
        "restart": restarts,
        "mooncake": {
            "requests": len(trace),
            "distinct_blocks": len(sizes),
            "reused_set_tokens": reused_set,
            "rows": mooncake_rows,
        },
    }
    # The same rows by name, for the docs: "<budget>" host only, "<budget>+disk" with the disk.
    report["mooncake"]["by_budget"] = {
        f"{row['budget']:g}{'+disk' if row['disk'] else ''}": row for row in mooncake_rows
    }
    for policy in POLICIES:
        for name, chosen in (("synthetic", rows), ("mooncake", mooncake_rows)):
            shares = [row[f"{policy}_of_belady"] for row in chosen]
            report[f"min_{policy}_of_belady_{name}"] = min(shares)
            report[f"max_{policy}_of_belady_{name}"] = max(shares)
    write_json(args.out, report)
    plot(report, args.out.with_suffix(".png"))
    print(
        json.dumps(
            {key: value for key, value in report.items() if key.startswith(("min_", "max_"))}
        )
    )


if __name__ == "__main__":
    main()
