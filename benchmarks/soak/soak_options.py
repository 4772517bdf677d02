"""The soak's options, one typed model; its command line (`python -m benchmarks.soak --help`) is
generated from the fields, so every default and help text is written once."""

from __future__ import annotations

import argparse
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, Field

RESULTS = Path(__file__).resolve().parent.parent / "results"
DESCRIPTION = "Bounded soak: mixed traffic against one real CPU server, a disk fault midway."


class SoakOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    minutes: float = Field(20.0, description="length of the traffic")
    out: Path = Field(RESULTS / "soak.json", description="JSON report; the PNG goes next to it")
    workers: int = Field(4, description="client threads sending the request mix")
    seed: int = Field(0, description="seed of the workers' random choices")
    request_timeout_s: float = Field(300.0, description="read timeout of /generate requests")
    admin_timeout_s: float = Field(120.0, description="read timeout of chunk/storage requests")
    replan_every_s: float = Field(30.0, description="period of the admin's TTL re-plans")
    read_every_s: float = Field(10.0, description="period of the admin's chunk/storage reads")
    sample_s: float = Field(5.0, description="period of the RSS and /health samples")
    report_every_s: float = Field(30.0, description="period of the progress lines")
    fault_at: float = Field(0.5, description="when the fault comes, as a fraction of the duration")
    corrupt_pages: int = Field(4, description="page files whose payload bytes the fault flips")
    initial_chunks: int = Field(8, description="chunks registered before the mix starts")
    new_chunk_share: float = Field(0.7, description="share of registrations of new paragraphs")
    max_total_tokens: int = Field(4096, description="the server's device KV pool, in tokens")
    chunked_prefill_size: int = Field(512, description="the server's chunked-prefill size")
    disk_capacity_mb: float = Field(384.0, description="capacity of the disk tier")
    disk_budget_mb: float | None = Field(
        None,
        description="average disk bytes the TTL plans may use (default: the capacity, so that "
        "bursts above the average are evicted while short-TTL groups expire)",
    )
    ttl_period_s: float = Field(60.0, description="the disk tier's TTL re-planning period")
    initial_ttl_s: float = Field(
        120.0, description="the disk tier's TTL before its page size is known (then paced)"
    )
    chunk_store_mb: float = Field(256.0, description="host memory for precomputed chunk KV")
    max_rss_growth: float = Field(0.05, description="acceptance: RSS growth over the window")
    keep_workdir: bool = Field(False, description="keep the disk dir (the log is always kept)")


def _value_type(annotation: Any) -> Any:
    """`float` of `float | None`; the annotation itself otherwise."""
    if isinstance(annotation, types.UnionType):
        return next(arg for arg in get_args(annotation) if arg is not type(None))
    return annotation


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=DESCRIPTION)
    for name, field in SoakOptions.model_fields.items():
        flag = name.replace("_", "-")
        if field.annotation is bool:  # a switch away from the default
            off = field.default is True
            parser.add_argument(
                f"--no-{flag}" if off else f"--{flag}",
                dest=name,
                action="store_false" if off else "store_true",
                help=field.description,
            )
        else:
            kind = _value_type(field.annotation)
            parser.add_argument(
                f"--{flag}", type=kind, default=field.default, help=field.description
            )
    return parser


def parse_options(argv: Sequence[str] | None = None) -> SoakOptions:
    return SoakOptions(**vars(build_parser().parse_args(argv)))
