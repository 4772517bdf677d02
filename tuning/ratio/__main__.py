"""Entry point of `hicache-ext-ratio` and `python -m sglang_hicache_ext.tuning.ratio`."""

from __future__ import annotations

import sys

from sglang_hicache_ext.tuning.ratio.cli import main

if __name__ == "__main__":
    sys.exit(main())
