"""The run: worker threads, the admin thread (periodic reads, TTL re-plans, the fault midway),
the monitor thread, and a progress bar over the duration."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
from tqdm import tqdm

from benchmarks.soak.admin import StorageAdmin
from benchmarks.soak.console import say
from benchmarks.soak.fault import FaultInjector
from benchmarks.soak.gate import TrafficGate
from benchmarks.soak.monitor import ServerMonitor
from benchmarks.soak.records import Recorder
from benchmarks.soak.server_process import process_alive
from benchmarks.soak.soak_options import SoakOptions
from benchmarks.soak.traffic import Traffic
from benchmarks.soak.workload import WEIGHTS


class Soak:
    def __init__(self, args: SoakOptions, log_path: Path, disk_dir: Path, traffic: Traffic) -> None:
        self.args = args
        self.traffic = traffic
        self.duration_s = args.minutes * 60.0
        self.stop = threading.Event()
        self.workers_done = threading.Event()
        self.recorder = Recorder(TrafficGate())
        client = traffic.client
        self.admin = StorageAdmin(client, args.admin_timeout_s, self.recorder.now)
        self.fault = FaultInjector(
            client, self.admin, self.recorder, disk_dir, traffic.shared_prompts, args
        )
        self.monitor = ServerMonitor(
            client.url, log_path, self.recorder.now, self.stop, args.sample_s
        )
        self.traffic_end_s: float | None = None

    # -- threads ------------------------------------------------------------------------------

    def worker(self, index: int) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        kinds = list(WEIGHTS)
        weights = [WEIGHTS[k] for k in kinds]
        gate = self.recorder.gate
        while not self.stop.is_set() and self.recorder.now() < self.duration_s:
            if not gate.wait_open(timeout_s=1.0) or not gate.try_enter():
                continue
            kind = self.traffic.resolve(rng.choices(kinds, weights)[0])
            self.recorder.timed(kind, lambda kind=kind: self.traffic.run(kind, rng), entered=True)

    def admin_loop(self) -> None:
        fault_at = self.duration_s * self.args.fault_at
        next_replan = self.args.replan_every_s
        next_read = self.args.read_every_s
        turn = 0
        timed = self.recorder.timed
        while not self.stop.is_set():
            now = self.recorder.now()
            if now >= self.duration_s:
                break
            if not self.fault.record and now >= fault_at:
                self.fault.inject(self.stop)
            elif now >= next_replan:
                timed("ttl_replan", self.admin.replan)
                next_replan = now + self.args.replan_every_s
            elif now >= next_read:
                if turn % 2 == 0:
                    timed("list_periodic", self.admin.list_chunks)
                else:
                    timed("storage_periodic", self.admin.read_storage)
                turn += 1
                next_read = now + self.args.read_every_s
            fault = self.fault.record
            if fault and "after_fault_60s" not in self.admin.snapshots and now >= fault["t"] + 60:
                self.admin.snapshot("after_fault_60s")
            self.stop.wait(0.5)

    def monitoring_done(self, t: float) -> bool:
        return t >= self.duration_s and self.workers_done.is_set()

    # -- main ---------------------------------------------------------------------------------

    def run(self, server: psutil.Process) -> None:
        self.recorder.start()
        monitor = threading.Thread(
            target=self.monitor.run, args=(server, self.monitoring_done), daemon=True
        )
        admin = threading.Thread(target=self.admin_loop, daemon=True)
        workers = [
            threading.Thread(target=self.worker, args=(i,), daemon=True)
            for i in range(self.args.workers)
        ]
        monitor.start()
        # A few chunks registered before the mix starts, so fused requests have something.
        for _ in range(self.args.initial_chunks):
            if self.stop.is_set():
                break
            self.recorder.timed("register", lambda: self.traffic.do_register(random.Random(0)))
        admin.start()
        for thread in workers:
            thread.start()
        self._wait_for_workers(workers)
        self.traffic_end_s = self.recorder.now()
        self.workers_done.set()
        self.stop.set()
        admin.join(timeout=self.args.admin_timeout_s + 5)
        monitor.join(timeout=30)
        if self.monitor.crash is None and process_alive(server):
            self.admin.snapshot("end")

    def _wait_for_workers(self, workers: list[threading.Thread]) -> None:
        """Until the workers end (duration reached, or 30 s after a crash), with a progress bar
        over the duration and a progress line every `--report-every-s`."""
        last_report = 0.0
        total = int(self.duration_s)
        # Seconds of traffic, not a rate: the bar shows elapsed / total and what was sent.
        bar_format = (
            "{desc}: {percentage:3.0f}%|{bar}| {n}/{total} s [{elapsed}<{remaining}{postfix}]"
        )
        with tqdm(total=total, desc="soak", bar_format=bar_format, disable=None) as bar:
            while any(t.is_alive() for t in workers):
                time.sleep(1.0)
                now = self.recorder.now()
                bar.update(max(0, min(int(now), total) - bar.n))
                bar.set_postfix_str(self.progress_line(), refresh=False)
                crash = self.monitor.crash
                if crash is not None and now > crash["t"] + 30:
                    break  # after a crash, do not wait for requests stuck until their timeout
                if now - last_report >= self.args.report_every_s:
                    last_report = now
                    say(f"[{now:7.1f}s] {self.progress_line()}")

    def progress_line(self) -> str:
        records = self.recorder.snapshot()
        classes = Counter(r.cls for r in records)
        samples = self.monitor.rss_samples
        rss = samples[-1][1] / 2**20 if samples else float("nan")
        counts = " ".join(f"{c}={n}" for c, n in sorted(classes.items()))
        return f"{len(records)} requests {counts}  RSS {rss:.0f} MiB"
