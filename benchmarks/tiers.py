"""Service tiers under open-loop Poisson load, four deployments side by side.

    python benchmarks/tiers.py [--rates 1,2,3,4] [--requests 100] [--policies ...]

Same flags as `tierserve bench tiers`. Prints the calibration (and the SLOs derived from
it), one line per policy and rate, then the capacity and fast-lane figures.
"""

import sys

from tierserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "tiers", *sys.argv[1:]]))
