"""The storage fault, injected from outside the server: flipped payload bytes and a deleted
page subdirectory under the disk dir, read back at once by two probe prompts."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.soak.admin import StorageAdmin
from benchmarks.soak.client import SoakClient
from benchmarks.soak.console import say
from benchmarks.soak.records import Outcome, Recorder
from benchmarks.soak.soak_options import SoakOptions
from sglang_hicache_ext.tiers.pages.page_file import read_header


def key_paths(root: Path) -> dict[str, Path]:
    """Page key -> file, from the page headers (read from outside the server)."""
    paths = {}
    for path in root.rglob("*.page"):
        with contextlib.suppress(Exception):  # evicted meanwhile, or a format we cannot read
            paths[read_header(path).key] = path
    return paths


def fault_targets(root: Path, pages: list[dict[str, Any]], now: float) -> list[Path]:
    """Page files under `root`, the best targets first: live pages that were read or refreshed
    after their write (reused, e.g. the shared system prefix) with the latest expiry, so that
    the requests after the fault read them while still live. `pages` is the store's own page
    list (`GET /hicache_ext/storage?pages=N`); a file is matched to it by the key in its header.
    Without usable headers: the most recently accessed files (mtime = last access) first."""
    info = {p.get("key"): p for p in pages if isinstance(p, dict)}
    scored = []
    for path in root.rglob("*.page"):
        try:
            mtime = path.stat().st_mtime
        except OSError:  # evicted or expired meanwhile
            continue
        try:
            page = info.get(read_header(path).key)
        except Exception:  # the file format may change: fall back to recency alone
            page = None
        if page is None:
            scored.append((False, 0.0, mtime, path))
            continue
        reused = page["last_access"] - page["write_time"] > 0.5
        scored.append((reused, page["expiry"] - now, mtime, path))
    scored.sort(key=lambda item: item[:3], reverse=True)
    return [item[3] for item in scored]


def flip_payload_bytes(path: Path) -> bool:
    """Invert up to 16 bytes in the second half of the file (the payload; the header is at the
    start). False when the file is gone."""
    with contextlib.suppress(OSError), open(path, "r+b") as handle:
        size = handle.seek(0, os.SEEK_END)
        for k in range(16):
            offset = size - 1 - k * 997
            if offset < size // 2:
                break
            handle.seek(offset)
            byte = handle.read(1)
            handle.seek(offset)
            handle.write(bytes([byte[0] ^ 0xFF]))
        return True
    return False


class FaultInjector:
    """`inject()` once, midway; `record` holds what it did and what the probes saw."""

    def __init__(
        self,
        client: SoakClient,
        admin: StorageAdmin,
        recorder: Recorder,
        disk_dir: Path,
        shared_prompts: list[str],
        args: SoakOptions,
    ) -> None:
        self.client = client
        self.admin = admin
        self.recorder = recorder
        self.disk_dir = disk_dir  # only files under our own temp disk dir are touched
        self.prompts = shared_prompts[:2]
        self.args = args
        self.record: dict[str, Any] = {}

    def _send(self, prompt: str) -> Outcome:
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        status, cls, response = self.client.call(
            "POST", "/generate", self.args.request_timeout_s, json=body
        )
        detail: dict[str, Any] = {}
        if cls == "2xx" and isinstance(response, dict):
            meta = response.get("meta_info") or {}
            detail["cached_tokens"] = meta.get("cached_tokens")
            detail["storage_tokens"] = (meta.get("cached_tokens_details") or {}).get("storage")
            detail["prompt_tokens"] = meta.get("prompt_tokens")
        return status, cls, detail

    def probe(self, prompt: str, step: str) -> dict[str, Any]:
        _, cls, detail = self.recorder.timed("fault_probe", lambda: self._send(prompt))
        return {"step": step, "class": cls, **detail}

    def locate(self, prompt: str, step: str, probes: list[dict[str, Any]]) -> list[str]:
        """Keys of the disk pages that `prompt` reads, in prefix order: every read sets the
        page's last access, one page after the other."""
        since = time.time() - 0.5
        probes.append(self.probe(prompt, step))
        read = [p for p in self.admin.page_listing() if p.get("last_access", 0) >= since]
        return [p["key"] for p in sorted(read, key=lambda p: p["last_access"])]

    def inject(self, stop: threading.Event) -> None:
        """Hold new requests and damage the disk tier from outside the server, then resume.

        Deterministic, so that the damage is read while the pages are live: after /flush_cache
        (device and host; the disk stays) shared-prefix prompt A, then prompt B (same system
        prefix, other records) are sent alone, and the disk pages each one read or wrote are
        found in the store's page list (by their last access, which also gives their order).
        Then: flip payload bytes of a page in the middle of A's pages and of
        `--corrupt-pages - 1` other hot pages, delete the page subdirectory of a page in the
        second half of B's own pages, and send B, then A, each alone after a flush: each should
        read its prefix from disk up to the damaged page and recompute the rest (the store
        counts corrupt_pages / io_errors). Then traffic resumes.
        """
        gate, t = self.recorder.gate, self.recorder.now()
        self.record = {"t": t}
        say(f"[{t:7.1f}s] fault: holding new requests")
        gate.hold()
        gate.drain(self.args.request_timeout_s + 30, stop)
        self.record["drained_s"] = self.recorder.now() - t
        self.admin.snapshot("before_fault")
        root = self.disk_dir
        prompt_a, prompt_b = self.prompts
        probes: list[dict[str, Any]] = []
        flushed = [self.admin.flush()]
        run_a = self.locate(prompt_a, "locate A", probes)
        run_b = self.locate(prompt_b, "locate B", probes)
        run_b = [k for k in run_b if k not in run_a]
        path_of = key_paths(root)
        files = fault_targets(root, self.admin.page_listing(), time.time())
        in_runs = {path_of.get(k) for k in run_a + run_b}
        middle_a = run_a[len(run_a) // 2] if run_a else None
        corrupt = [path_of[middle_a]] if middle_a in path_of else []
        corrupt += [f for f in files if f not in in_runs][
            : max(0, self.args.corrupt_pages - len(corrupt))
        ]
        corrupted = [str(path.relative_to(root)) for path in corrupt if flip_payload_bytes(path)]
        corrupted_dirs = {path.parent for path in corrupt}
        candidates = [path_of.get(k) for k in run_b[len(run_b) // 2 :]] + files
        deleted_dir, deleted_files = None, 0
        for path in candidates:
            if path is not None and path.parent not in corrupted_dirs and path.parent.is_dir():
                deleted_files = sum(1 for _ in path.parent.glob("*.page"))
                shutil.rmtree(path.parent, ignore_errors=True)
                deleted_dir = str(path.parent.relative_to(root))
                break
        # Each alone after a flush: a storage prefetch needs a long enough miss (SGLang's
        # prefetch threshold), so B must not find the shared system prefix on the device.
        flushed.append(self.admin.flush())
        probes.append(self.probe(prompt_b, "after fault B"))
        flushed.append(self.admin.flush())
        probes.append(self.probe(prompt_a, "after fault A"))
        self.record.update(
            pages_on_disk=len(files),
            disk_run_pages={"A": len(run_a), "B": len(run_b)},
            corrupted_files=corrupted,
            deleted_dir=deleted_dir,
            deleted_dir_pages=deleted_files,
            flushed_device_and_host=flushed,
            probes=probes,
        )
        after = self.admin.snapshot("after_probes")
        self.record["held_s"] = self.recorder.now() - t
        gate.resume()
        disk = (after or {}).get("disk") or {}
        say(
            f"[{self.recorder.now():7.1f}s] fault: disk runs A {len(run_a)} / B {len(run_b)} "
            f"pages; {len(corrupted)} of {len(files)} page files corrupted, {deleted_dir} deleted "
            f"({deleted_files} pages); probes after: storage tokens "
            f"{[p.get('storage_tokens') for p in probes[-2:]]}; corrupt_pages "
            f"{disk.get('corrupt_pages')}, io_errors {disk.get('io_errors')}; resumed after "
            f"{self.record['held_s']:.1f}s"
        )
