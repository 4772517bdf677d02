"""Entry point of `python -m sglang_hicache_ext.tuning.ttl`."""

import os

# SLSQP's tiny dense solves slow down by 10-100x when OpenBLAS spreads them over busy cores.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from sglang_hicache_ext.tuning.ttl.cli import main  # noqa: E402

raise SystemExit(main())
