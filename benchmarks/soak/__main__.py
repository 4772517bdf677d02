"""`python -m benchmarks.soak` (from the repository root): start the server, run, report."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.soak.client import SoakClient
from benchmarks.soak.console import print_summary, say
from benchmarks.soak.plot import plot
from benchmarks.soak.run import Soak
from benchmarks.soak.server_process import find_server_process
from benchmarks.soak.soak_options import SoakOptions, parse_options
from benchmarks.soak.summary import summarise
from benchmarks.soak.traffic import Traffic
from scripts.prepare_models import SMOLLM2, prepare
from sglang_hicache_ext.evaluation.hotpotqa import load_hotpotqa
from sglang_hicache_ext.sglang_ext.disk_tier.storage_backend import disk_tier_extra_config
from sglang_hicache_ext.sglang_ext.server.launcher import (
    ServerConfig,
    ServerStartError,
    running_server,
)
from sglang_hicache_ext.sglang_ext.server.ports import free_port


def disk_tier_config(args: SoakOptions, disk_dir: Path) -> dict[str, Any]:
    """A small disk tier with short TTL periods, so pages expire, get evicted and re-planned."""
    return {
        **disk_tier_extra_config(str(disk_dir)),
        "capacity_bytes": args.disk_capacity_mb * 2**20,
        "disk_budget_bytes": (args.disk_budget_mb or args.disk_capacity_mb) * 2**20,
        "ttl_policy": "group",
        "ttl_groups": 4,
        "ttl_period_s": args.ttl_period_s,
        "initial_ttl_s": args.initial_ttl_s,
        "purge_interval_s": 1.0,
        "hicache_ext_config": {"chunk_store_bytes": int(args.chunk_store_mb * 2**20)},
    }


def server_config(args: SoakOptions, model: Path, disk_extra: dict[str, Any]) -> ServerConfig:
    return ServerConfig(
        model_path=str(model),
        port=free_port(),
        max_total_tokens=args.max_total_tokens,
        hierarchical_cache=True,
        hicache_storage_backend="dynamic",
        extra_args=(
            "--hicache-ratio",
            "4",
            "--chunked-prefill-size",
            str(args.chunked_prefill_size),
            "--hicache-storage-backend-extra-config",
            json.dumps(disk_extra),
        ),
    )


def write_report(path: Path, report: dict[str, Any], indent: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=indent) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_options(argv)
    from transformers import AutoTokenizer

    model = prepare(SMOLLM2)
    tokenizer = AutoTokenizer.from_pretrained(model)
    examples = load_hotpotqa(400, seed=11)
    workdir = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    disk_extra = disk_tier_config(args, workdir / "disk")
    config = server_config(args, model, disk_extra)
    log_path = workdir / "server.log"
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    say(f"soak: {args.minutes:g} min, {args.workers} workers; server log {log_path}")
    traffic = Traffic(SoakClient(config.url), examples, tokenizer, args)
    soak = Soak(args, log_path, workdir / "disk", traffic)
    try:
        with running_server(config, log_path=log_path):
            server = find_server_process(config.port)
            say(f"server up (pid {server.pid}); traffic starts")
            soak.run(server)
    except ServerStartError as error:
        print(f"server did not start: {error}", file=sys.stderr)
        report = {
            "benchmark": "soak",
            "started_at": started_at,
            "crashes": 1,
            "startup_error": str(error),
            "acceptance": {"pass": False},
        }
        write_report(args.out, report, indent=2)
        return 1
    finally:
        if not args.keep_workdir:
            shutil.rmtree(workdir / "disk", ignore_errors=True)
    report = summarise(soak, args, config, {"started_at": started_at, "disk_extra": disk_extra})
    write_report(args.out, report, indent=1)
    png = args.out.with_suffix(".png")
    plot(report, png)
    print_summary(report)
    print(f"results: {args.out}, {png}; server log {log_path}")
    return 0 if report["acceptance"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
