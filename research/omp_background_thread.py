"""Does a background thread that ran torch ops slow the scheduler thread's own ops?

One question behind `ShortLivedWorker` (`tiers/short_lived_worker.py`): the time of
2,000 small element-wise ops (each one OpenMP parallel region on this CPU torch) on the main
thread, before any other thread ran a torch op, after a thread that ran one op ended, while a
`ThreadPoolExecutor` thread that ran one op is still alive (idle), and after a
`ShortLivedWorker` job. Medians over `--repeats` timings of each.

    python -m research.omp_background_thread     # research/results/omp_background_thread.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from sglang_hicache_ext.tiers.short_lived_worker import ShortLivedWorker

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS / "omp_background_thread.json")
    args = parser.parse_args()
    x, y = torch.randn(200_000), torch.randn(200_000)

    def one_op() -> None:
        torch.add(x, y)

    def timed() -> float:
        runs = []
        for _ in range(args.repeats):
            began = time.perf_counter()
            for _ in range(args.ops):
                torch.add(x, y)
            runs.append(time.perf_counter() - began)
        return statistics.median(runs)

    seconds = {"alone": timed()}
    ended = threading.Thread(target=one_op)
    ended.start()
    ended.join()
    seconds["after_a_thread_that_ended"] = timed()
    ShortLivedWorker("study").submit(one_op).result()
    time.sleep(0.1)  # the job's thread ends just after it hands over the result
    seconds["after_a_short_lived_worker_job"] = timed()
    with ThreadPoolExecutor(1) as pool:
        pool.submit(one_op).result()
        seconds["while_a_pool_thread_that_ran_an_op_lives"] = timed()
    seconds["after_the_pool_shut_down"] = timed()
    report = {
        "command": "python -m research.omp_background_thread",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "ops": args.ops,
        "seconds": seconds,
        "ratio_to_alone": {k: v / seconds["alone"] for k, v in seconds.items()},
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
