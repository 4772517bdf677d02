import sys

from tuning.pareto.cli import main

sys.exit(main())
