"""Where a fused request's time goes on the server, next to the normal prefill's (issue 56).

SmolLM2-135M-Instruct on the CPU server, the break-even benchmark's settings and prompts
(`benchmarks/fusion_break_even.py`: `auto_chunks`, `fusion_by_default`, `fusion_min_matched_share`
0, and its warm-up: a pool of paragraphs asked once, a fused prompt for the model check, one of the
measured shape), then `--prompts` prompts of `--per-request` paragraphs, `--seen` of them from the
pool. Each prompt is sent fused and then with fusion off (one output token each), one at a time,
while py-spy samples the scheduler's main thread (50 Hz, busy samples only) for exactly that
request. Each sample is charged to the first stage its stack enters: the executor's scoring
pass, its loads of stored rows, its KV assembly, the rest of its layers; around it the fused
batch's KV write, capture and logits; planning (matching, pinning); SGLang's own forward (the
fusion-off request, and decodes); the scheduler's other work.

Needs py-spy (`pip install py-spy`), which is not a dependency of the package.

    python -m research.fused_path_profile      # benchmarks/results/fused_path_profile.json
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from benchmarks.auto_reuse import fusion_counters
from benchmarks.fusion_break_even import (
    QUESTION,
    half_new_parser,
    prompts,
    warmed_server,
)
from benchmarks.smollm2_server import RESULTS, report_header, write_json
from examples.openai_rag import SYSTEM, Answer, ask
from sglang_hicache_ext.sglang_ext.server.launcher import server_process_group

RATE_HZ = 50

# (stage, frames that mark it), the first match wins, in this order.
STAGES = (
    ("executor: scoring pass", ("_scoring_pass",)),
    ("executor: loads of stored rows", ("_load_reused",)),
    ("executor: KV assembly", ("_assemble",)),
    ("executor: layers", ("fused_prefill_batch",)),
    ("fused batch: capture", ("_capture_pieces",)),
    ("fused batch: KV write", ("_write",)),
    ("fused batch: other", ("run_fused_batch",)),
    ("planning", ("plan_batch",)),
    ("capture: storing pieces", ("AutoCapture.before_forward",)),
    ("SGLang forward", ("ModelRunner._forward_raw",)),
)


def stage_of(frames: list[str]) -> str:
    for stage, marks in STAGES:
        if any(mark in frames for mark in marks):
            return stage
    return "scheduler: other"


def stage_samples(raw: str) -> Counter[str]:
    """Samples per stage of the scheduler's main thread in a py-spy raw file's text (collapsed
    stacks, the thread first); its other threads (watchdog, capture) are left out."""
    counts: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        thread, *frames = stack.split(";")
        if thread.endswith("MainThread"):
            counts[stage_of([frame.split(" (")[0] for frame in frames])] += int(count)
    return counts


def profiled(pid: int, send: Callable[[], Answer]) -> tuple[float, Counter[str]]:
    """TTFT of `send()` (an `Answer`), and the scheduler's samples per stage meanwhile."""
    out = Path(tempfile.mkdtemp(prefix="fused-path-")) / "stacks.txt"
    spy = subprocess.Popen(
        [
            "py-spy",
            "record",
            "-p",
            str(pid),
            "-r",
            str(RATE_HZ),
            "-f",
            "raw",
            "-o",
            str(out),
            "--threads",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.5)  # attached before the request arrives
    answer = send()
    spy.send_signal(2)
    spy.wait()
    return answer.ttft_s, stage_samples(out.read_text())


def scheduler_pid(port: int) -> int:
    """The scheduler process of the server on `port` (its process group's `sglang::scheduler`)."""
    group = server_process_group(port)
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            if os.getpgid(process.pid) != group:
                continue
        except ProcessLookupError:
            continue
        if any("sglang::scheduler" in part for part in process.info["cmdline"] or []):
            return process.pid
    raise LookupError(f"no scheduler process in the server on port {port}")


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for kind in ("fused", "off"):
        total: Counter[str] = Counter()
        for run in runs:
            total.update(run[f"{kind}_samples"])
        samples = sum(total.values())
        summary[kind] = {
            "samples": samples,
            "share": {stage: count / samples for stage, count in total.most_common()},
        }
    ratios = [run["fused_ttft_s"] / run["off_ttft_s"] for run in runs]
    summary["ttft_ratio_paired"] = statistics.median(ratios)
    summary["ttft_ratios"] = ratios
    return summary


def main() -> int:
    parser = half_new_parser(__doc__.splitlines()[0], 4, RESULTS / "fused_path_profile.json")
    args = parser.parse_args()
    traffic = prompts(args.per_request, args.prompts, [args.seen])
    runs: list[dict[str, Any]] = []
    with warmed_server("fused-path", traffic) as (server, client, _):
        pid = scheduler_pid(server.port)
        for number, (_, docs) in enumerate(traffic.measured):
            fused_ttft, fused = profiled(
                pid, lambda docs=docs: ask(client, "default", docs, QUESTION, max_tokens=1)
            )
            fusion_counters(server.url)
            off_ttft, off = profiled(
                pid,
                lambda docs=docs, number=number: ask(
                    client,
                    "default",
                    docs,
                    QUESTION,
                    system=f"{number}. {SYSTEM}",
                    fusion=False,
                    max_tokens=1,
                ),
            )
            runs.append(
                {
                    "fused_ttft_s": fused_ttft,
                    "off_ttft_s": off_ttft,
                    "fused_samples": dict(fused),
                    "off_samples": dict(off),
                }
            )
    report: dict[str, Any] = {
        **report_header("research.fused_path_profile"),
        "summary": summarise(runs),
    }
    report["runs"] = runs
    write_json(args.out, report)
    print(json.dumps(report["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
