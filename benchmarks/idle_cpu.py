"""CPU an idle server burns: SGLang on CPU started as the README says, with and without `--sleep-on-idle`.

For each setting the server is started, answers one request (so every lazy path has run), rests
`--settle-s`, and then the CPU time (user + system) of its whole process group is read from
/proc before and after `--window-s` seconds of idleness: the figure is the percentage of one core.
Both settings run in the same invocation, one server at a time.

    python benchmarks/idle_cpu.py --model-path ~/.cache/sglang-hicache-ext/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
from tqdm import tqdm

from sglang_hicache_ext.sglang_ext.server.launcher import stop_process_group
from sglang_hicache_ext.sglang_ext.server.ports import free_port

RESULTS = Path(__file__).resolve().parent / "results" / "idle_cpu.json"
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def readme_command(model_path: str, port: int, sleep_on_idle: bool) -> list[str]:
    """The CPU command of README.md, with `--sleep-on-idle` optional."""
    command = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
        "--device", "cpu", "--dtype", "float32", "--attention-backend", "torch_position",
        "--radix-cache-backend", "hicache_ext", "--port", str(port), "--host", "127.0.0.1",
        "--max-total-tokens", "16384", "--mem-fraction-static", "0.3", "--skip-server-warmup",
    ]  # fmt: skip
    return [*command, "--sleep-on-idle"] if sleep_on_idle else command


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process in a process group."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended while we were reading
        # After the command name: state(0) ppid(1) pgrp(2) ... utime(11) stime(12).
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / TICKS_PER_S


def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with status {process.returncode}")
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1.0)
    raise RuntimeError("server did not become healthy")


def measure(model_path: str, sleep_on_idle: bool, settle_s: float, window_s: float) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            readme_command(model_path, port, sleep_on_idle),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_healthy(url, process)
            body = {"text": "Hello", "sampling_params": {"max_new_tokens": 4}}
            requests.post(url + "/generate", json=body, timeout=300).raise_for_status()
            time.sleep(settle_s)
            before, started = group_cpu_seconds(process.pid), time.monotonic()
            for _ in tqdm(
                range(int(window_s)), desc=f"idle, sleep_on_idle={sleep_on_idle}", disable=None
            ):
                time.sleep(1.0)
            cpu_s = group_cpu_seconds(process.pid) - before
            elapsed = time.monotonic() - started
        finally:
            stop_process_group(process)
    return {
        "sleep_on_idle": sleep_on_idle,
        "window_s": round(elapsed, 2),
        "cpu_s": round(cpu_s, 3),
        "core_percent": round(100.0 * cpu_s / elapsed, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--settle-s", type=float, default=10.0)
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    rows = [measure(args.model_path, flag, args.settle_s, args.window_s) for flag in (True, False)]
    for row in rows:
        print(f"sleep_on_idle={row['sleep_on_idle']}: {row['core_percent']} % of a core "
              f"({row['cpu_s']} CPU s over {row['window_s']} s)")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model_path": args.model_path, "runs": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
