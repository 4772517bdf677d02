"""Wheels for the GPU machine's run of `benchmarks/fusion_gpu.py`: FlashInfer and its one import
need, trimmed to what the single-request prefill kernels compile from.

The GPU machine has CUDA torch, Triton and nvcc but no FlashInfer, and cannot reach a registry;
what it needs travels with the working tree, 64 MiB per call in all. FlashInfer's wheel (0.7.2,
the version sglang 0.5.23 pins) is 62 MiB, almost all of it CUDA sources and prebuilt kernels of
other operations (MoE, MLA, sampling, Blackwell GEMMs). This keeps every Python module (so
`import flashinfer` behaves as released) and the headers the JIT build of
`single_prefill_with_kv_cache` includes, and drops the sources of other operations.

    python -m scripts.device_wheels        # -> .whl/ (ignored by git; `carry` it)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FLASHINFER = "flashinfer-python==0.7.2"
# What `import flashinfer` needs that the GPU machine's image lacks (its package list:
# /work/.library/device/KINDS.md); the rest of FlashInfer's requirements are imported lazily.
IMPORT_NEEDS = ("apache-tvm-ffi>=0.1.11,<0.2",)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# Kept from flashinfer/data: the headers and the top-level sources (the single/batch prefill
# and decode kernels and their bindings); the sub-folders of csrc are other operations' kernels.
KEPT_DATA = (
    "flashinfer/data/include/",
    "flashinfer/data/cutlass/",
    "flashinfer/data/cccl/",  # FlashInfer needs a newer CCCL than CUDA 13.0 ships
    "flashinfer/data/spdlog/",
)


def download(spec: str, dest: Path, python: str) -> Path:
    before = set(dest.glob("*.whl"))
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--python-version", python, "--implementation", "cp", *platforms, "-d", str(dest), spec],
        check=True,
    )  # fmt: skip
    new = set(dest.glob("*.whl")) - before
    name = spec.split("=")[0].split("<")[0].split(">")[0].replace("-", "_")
    return next(iter(new), None) or next(dest.glob(f"{name}-*.whl"))


def kept(name: str) -> bool:
    if not name.startswith("flashinfer/"):
        return True  # dist-info
    if name.startswith("flashinfer/data/"):
        if name.startswith(KEPT_DATA):
            return True
        rest = name.removeprefix("flashinfer/data/csrc/")
        return rest != name and "/" not in rest
    # Python modules always; other files (prebuilt cubins, kernel sources) only outside the
    # folders of unrelated operations.
    unrelated = ("flashinfer/experimental/", "flashinfer/fused_moe/", "flashinfer/moe_ep/")
    return name.endswith(".py") or not name.startswith(unrelated)


def trim(wheel: Path) -> Path:
    """Rewrite `wheel` in place without the files `kept` rejects (RECORD is not checked by
    `pip install --no-deps`; a trimmed file would only fail `pip check`)."""
    trimmed = wheel.with_suffix(".trimmed")
    with (
        zipfile.ZipFile(wheel) as source,
        zipfile.ZipFile(trimmed, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as target,
    ):
        for info in source.infolist():
            if kept(info.filename):
                target.writestr(info, source.read(info.filename))
    trimmed.replace(wheel)
    return wheel


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=REPO / ".whl")
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python")
    args = parser.parse_args()
    args.dest.mkdir(parents=True, exist_ok=True)
    for old in args.dest.glob("*.whl"):
        old.unlink()
    wheels = [trim(download(FLASHINFER, args.dest, args.python))]
    wheels += [download(spec, args.dest, args.python) for spec in IMPORT_NEEDS]
    total = sum(w.stat().st_size for w in wheels)
    for wheel in wheels:
        print(f"{wheel.name}: {wheel.stat().st_size / 2**20:.1f} MiB")
    print(f"total {total / 2**20:.1f} MiB (the working tree that travels has 64 MiB in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
