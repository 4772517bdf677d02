"""The model and server the CPU benchmarks measure: SmolLM2-135M-Instruct behind the plugin.

Run the benchmarks from the repository root as modules (`python -m benchmarks.fusion_speed`), so
that `benchmarks` imports; prepare the model first (`make models`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sglang_hicache_ext.evaluation.model_paths import PREPARE_HINT, SMOLLM2, prepared_model
from sglang_hicache_ext.sglang_ext.server.launcher import ServerConfig, running_server
from sglang_hicache_ext.sglang_ext.server.ports import free_port

MODEL = SMOLLM2
RESULTS = Path(__file__).resolve().parent / "results"


def smollm2_path() -> Path:
    """The prepared model folder; exits with how to prepare it when it is not."""
    folder = prepared_model(SMOLLM2)
    if folder is None:
        raise SystemExit(f"{SMOLLM2} is not prepared; run `{PREPARE_HINT}` (or `make models`)")
    return folder


def smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path())


@contextmanager
def smollm2_server(label: str, **settings: Any) -> Iterator[ServerConfig]:
    """A server on a free port with `settings` (`ServerConfig` fields), stopped on exit; its log
    is `server.log` in a fresh temporary folder named after `label`."""
    config = ServerConfig(model_path=str(smollm2_path()), port=free_port(), **settings)
    log_path = Path(tempfile.mkdtemp(prefix=f"bench-{label}-")) / "server.log"
    with running_server(config, log_path=log_path):
        yield config


def server_benchmark_parser(doc: str, result_name: str) -> argparse.ArgumentParser:
    """Arguments of a server benchmark: described by `doc`'s first line, `--out` defaulting to
    `benchmarks/results/<result_name>`."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / result_name)
    parser.add_argument(
        "--repeats", type=int, default=5, help="prompts measured; medians over them"
    )
    return parser


def write_json(path: Path, value: Any, indent: int = 1) -> None:
    """`value` as JSON (with `indent`, a final newline) in `path`, its folder created."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=indent) + "\n")


def report_header(module: str) -> dict[str, str]:
    """The first keys of a report of benchmark `module` ("benchmarks.auto_reuse"): the command
    line it ran as, the commit it ran at ("-dirty" with uncommitted changes; None outside a
    checkout) and the model it measured."""
    described = subprocess.run(
        ["git", "describe", "--always", "--dirty"],
        cwd=Path(__file__).resolve().parent,
        capture_output=True,
        text=True,
        check=False,
    )
    return {
        "command": f"python -m {module} " + " ".join(sys.argv[1:]),
        "commit": described.stdout.strip() or None,
        "model": MODEL,
    }


def write_report(
    report: dict[str, Any], out: Path, plot: Callable[[dict[str, Any], Path], object], brief: Any
) -> int:
    """Write `report` to `out` as JSON, draw it beside (`plot(report, out.png)`) and print
    `brief` (what the run shows at a glance) as JSON; the benchmark's exit status, 0."""
    out.write_text(json.dumps(report, indent=1))
    plot(report, out.with_suffix(".png"))
    print(json.dumps(brief, indent=1))
    return 0
