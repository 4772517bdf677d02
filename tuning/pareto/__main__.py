import sys

from sglang_hicache_ext.tuning.pareto.cli import main

sys.exit(main())
