"""Entry point of `hicache-ext-ttl` and `python -m sglang_hicache_ext.tuning.ttl`."""

from __future__ import annotations

import os
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    # SLSQP's tiny dense solves slow down by 10-100x when OpenBLAS spreads them over busy cores.
    # OpenBLAS reads the variable when numpy loads, so it is set before the CLI is imported.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from sglang_hicache_ext.tuning.ttl.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
