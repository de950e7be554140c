"""A plan checked against a real run: see src/tierserve/bench/plan_check.py.

    python benchmarks/plan_check.py [--rate 1.0] [--requests 80] [--cells best|all]
"""

import sys

from tierserve.bench.plan_check import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
