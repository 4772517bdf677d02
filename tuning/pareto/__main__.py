"""Entry point of `hicache-ext-pareto` and `python -m sglang_hicache_ext.tuning.pareto`."""

from sglang_hicache_ext.tuning.pareto.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
