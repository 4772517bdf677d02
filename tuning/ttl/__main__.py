"""Entry point of `python -m tuning.ttl`."""

import os

# SLSQP's tiny dense solves slow down by 10-100x when OpenBLAS spreads them over busy cores.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from tuning.ttl.cli import main  # noqa: E402

raise SystemExit(main())
