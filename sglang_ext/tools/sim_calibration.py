"""Calibrate the serving simulator on the real CPU SGLang server, and check its fidelity.

    hicache-ext-calibrate profile --out profile.json
    hicache-ext-calibrate fidelity --profile profile.json --out fidelity.json

(or `python -m sglang_hicache_ext.sglang_ext.tools.sim_calibration ...`). `profile` measures the
server and fits the simulator's profile (`calibration_profile`); `fidelity` replays a scaled
trace slice on the server and through the simulator and compares them (`calibration_fidelity`).
The model is `--model-path`, by default SmolLM2 as `scripts/prepare_models.py` prepares it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from sglang_hicache_ext.evaluation.model_paths import PREPARE_HINT, SMOLLM2, prepared_model
from sglang_hicache_ext.tuning.sim.profile import Profile
from sglang_hicache_ext.tuning.sim.scaled_slice import SliceSpec


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hicache-ext-calibrate", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    prof = sub.add_parser("profile", help="measure the CPU server and write the simulator profile")
    prof.add_argument("--out", type=Path, required=True)
    fid = sub.add_parser(
        "fidelity", help="replay a scaled trace slice on the server and the simulator"
    )
    fid.add_argument("--profile", type=Path, required=True, help="output of `profile`")
    fid.add_argument(
        "--trace", type=Path, required=True, help="JSONL request trace (Mooncake format)"
    )
    fid.add_argument("--first", type=int, default=0)
    fid.add_argument("--requests", type=int, default=200)
    fid.add_argument("--conversation-stride", type=int, default=16)
    fid.add_argument("--time-scale", type=float, default=0.5)
    fid.add_argument("--out", type=Path, required=True)
    for command in (prof, fid):
        command.add_argument(
            "--model-path",
            type=Path,
            default=prepared_model(SMOLLM2),
            help=f"HF model folder (default: {SMOLLM2} prepared by `{PREPARE_HINT}`, if it is)",
        )
        command.add_argument(
            "--workdir", type=Path, default=Path("/tmp/sglang-ext-sim-calibration")
        )
    return parser


def model_error(model_path: Path | None) -> str | None:
    """Why `model_path` cannot be served, in one line; None when it can."""
    if model_path is None:
        return f"no model: pass --model-path, or prepare {SMOLLM2} with `{PREPARE_HINT}`"
    if not (model_path / "config.json").is_file():
        return f"--model-path {model_path}: no config.json there (not a prepared HF model folder)"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    error = model_error(args.model_path)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 2
    # The measuring modules import SGLang (through the disk tier): loaded once the arguments hold.
    from sglang_hicache_ext.sglang_ext.tools.calibration_fidelity import fidelity
    from sglang_hicache_ext.sglang_ext.tools.calibration_profile import calibrate

    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.command == "profile":
        report = calibrate(args.model_path, args.workdir)
    else:
        calibrated = json.loads(args.profile.read_text())
        profile = Profile.from_mapping(
            calibrated.get("profile", calibrated), source=str(args.profile)
        )
        spec = SliceSpec(
            first=args.first,
            count=args.requests,
            time_scale=args.time_scale,
            conversation_stride=args.conversation_stride,
        )
        report = {
            "profile": profile.to_json(),
            **fidelity(args.model_path, profile, spec, args.trace, args.workdir),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
