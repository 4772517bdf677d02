"""SIGKILL a server while it writes chunks to its disk tier, again and again; check every restart.

Tiny Llama on the CPU server with `chunk_disk_dir` (one directory for all trials). Per trial:
start the server on that directory; a client thread registers fresh documents (`POST /chunks`,
each answered only after its chunk file is on disk) until, after a random delay, the whole
server process group gets SIGKILL. Before every third restart one committed chunk file is
damaged (a flipped byte in a K row, as a bad sector would). Each restart must:
  - come up healthy;
  - list every chunk whose registration was answered before the kill (none lost);
  - count the writes the kill cut short (`stats.disk.interrupted_writes`, temp files removed);
  - fuse a request over restored chunks (answered from disk, no fallback);
  - never use the damaged chunk: a request over it reads its rows, finds the bad checksum, and
    is answered by the normal prefill (`fallback: chunk_unreadable`); the chunk is dropped and
    counted (`stats.disk.corrupt_dropped`) and no longer listed.
At the end every chunk file left is read whole and verified. JSON in
benchmarks/results/chunk_kill_trials.json.

    python -m benchmarks.chunk_kill_trials [--trials 20]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests

from benchmarks.smollm2_server import RESULTS
from sglang_hicache_ext.evaluation.model_paths import TINY_LLAMA, prepared_model
from sglang_hicache_ext.sglang_ext.server.launcher import (
    ServerConfig,
    running_server,
    server_process_group,
)
from sglang_hicache_ext.sglang_ext.server.ports import free_port
from sglang_hicache_ext.tiers.chunks.disk_tier import CHUNK_SUFFIX, ChunkDiskTier
from sglang_hicache_ext.tiers.chunks.stored_forms import read_chunk, read_header

WORDS = [
    "amber",
    "basalt",
    "cobalt",
    "delta",
    "ember",
    "fjord",
    "granite",
    "harbor",
    "indigo",
    "juniper",
    "kelp",
    "lagoon",
]


def _document(rng: random.Random, label: str) -> str:
    return f"Note {label}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 200)))


def _register_until_killed(
    url: str, rng: random.Random, trial: int, acknowledged: dict[str, str]
) -> None:
    for index in range(10_000):
        text = _document(rng, f"{trial}.{index}")
        try:
            response = requests.post(url + "/chunks", json={"text": text}, timeout=60)
        except requests.RequestException:
            return  # the server is gone
        if response.status_code == 200:
            acknowledged[response.json()["id"]] = text


def _fused(url: str, documents: list[str], **options: Any) -> dict[str, Any]:
    custom = {"fusion": True, **{f"fusion_{k}": v for k, v in options.items()}}
    body = {
        "text": "Notes:\n" + "\n".join(documents) + "\nWhich note is longest?",
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "custom_params": custom},
    }
    response = requests.post(url + "/generate", json=body, timeout=300)
    response.raise_for_status()
    return response.json()["meta_info"]["hicache_ext_fusion"][0]


def _damage_one(chunk_dir: Path, rng: random.Random) -> str | None:
    files = sorted(chunk_dir.rglob(f"*{CHUNK_SUFFIX}"))
    if not files:
        return None
    path = rng.choice(files)
    header = read_header(path)
    offset = header.key_offset(rng.randrange(header.num_layers)) + rng.randrange(
        header.key_row_bytes * header.num_tokens
    )
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0x20]))
    return header.key


def _chunks(url: str) -> dict[str, Any]:
    return requests.get(url + "/chunks", timeout=60).json()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS / "chunk_kill_trials.json")
    args = parser.parse_args()
    model = prepared_model(TINY_LLAMA)
    if model is None:
        raise SystemExit("run `make models` first")
    rng = random.Random(0)
    work = Path(tempfile.mkdtemp(prefix="kill-trials-"))
    settings = work / "hicache_ext.json"
    settings.write_text(json.dumps({"chunk_disk_dir": str(work / "chunks")}))
    config = ServerConfig(
        model_path=str(model),
        port=free_port(),
        max_total_tokens=4096,
        env={"SGLANG_HICACHE_EXT_CONFIG": str(settings)},
    )
    acknowledged: dict[str, str] = {}
    damaged: set[str] = set()
    trials = []
    for trial in range(args.trials + 1):  # the last start only checks the last kill
        row: dict[str, Any] = {"trial": trial}
        began = time.monotonic()
        with running_server(config, log_path=work / f"server-{trial}.log"):
            row["start_s"] = time.monotonic() - began
            listing = _chunks(config.url)
            listed = {chunk["id"] for chunk in listing["chunks"]}
            disk = listing["stats"]["disk"]
            row["listed"] = len(listed)
            row["lost_acknowledged"] = sorted(set(acknowledged) - listed - damaged)
            row["interrupted_writes"] = disk["interrupted_writes"]
            healthy = [acknowledged[k] for k in listed - damaged if k in acknowledged][:3]
            if healthy:
                info = _fused(config.url, healthy)
                row["fused_from_disk"] = info.get("fused", False) and "disk" in info.get(
                    "chunks_by_tier", {}
                )
            for key in sorted(damaged & listed):
                if key in acknowledged:  # all its rows are read at r = 0
                    info = _fused(config.url, [acknowledged[key]], selector="reuse")
                    row.setdefault("damaged_fallbacks", []).append(info.get("fallback"))
            after = _chunks(config.url)
            row["damaged_listed_after_use"] = sorted(
                damaged & {chunk["id"] for chunk in after["chunks"]}
            )
            row["corrupt_dropped"] = after["stats"]["disk"]["corrupt_dropped"]
            if trial == args.trials:
                trials.append(row)
                break
            writer = threading.Thread(
                target=_register_until_killed,
                args=(config.url, random.Random(trial), trial, acknowledged),
            )
            writer.start()
            time.sleep(rng.uniform(0.3, 2.5))
            os.killpg(server_process_group(config.port), signal.SIGKILL)
            writer.join(timeout=120)
        row["acknowledged_total"] = len(acknowledged)
        if trial % 3 == 2:
            key = _damage_one(work / "chunks", rng)
            if key is not None:
                damaged.add(key)
                row["damaged"] = key[:12]
        trials.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "lost_acknowledged"}), flush=True)
        time.sleep(1.0)
    directories = [p for p in (work / "chunks").rglob("*") if p.is_dir()]
    verified = 0
    for directory in directories:
        tier = ChunkDiskTier(directory, 10**12)
        for key in tier.keys_by_recency():
            read_chunk(directory / f"{key}{CHUNK_SUFFIX}", expected_key=key)
            verified += 1
    report = {
        "benchmark": "chunk_kill_trials",
        "model": TINY_LLAMA,
        "kills": args.trials,
        "starts_ok": sum(1 for row in trials if "start_s" in row),
        "acknowledged_registrations": len(acknowledged),
        "lost_acknowledged": sorted({k for row in trials for k in row["lost_acknowledged"]}),
        "damaged_files": len(damaged),
        "damaged_fallbacks": [f for row in trials for f in row.get("damaged_fallbacks", [])],
        "damaged_listed_after_use": sorted(
            {k for row in trials for k in row["damaged_listed_after_use"]}
        ),
        "fused_from_disk_after_restart": sum(1 for row in trials if row.get("fused_from_disk")),
        "corrupt_dropped_total": sum(row["corrupt_dropped"] for row in trials),
        "interrupted_writes_total": sum(row["interrupted_writes"] for row in trials),
        "chunk_files_verified_at_end": verified,
        "trials": trials,
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "trials"}, indent=1))
    ok = (
        report["starts_ok"] == args.trials + 1
        and not report["lost_acknowledged"]
        and not report["damaged_listed_after_use"]
        and all(f == "chunk_unreadable" for f in report["damaged_fallbacks"])
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
