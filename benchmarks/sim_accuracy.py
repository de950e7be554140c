"""`tierserve bench sim-accuracy` as a script (same flags); see src/tierserve/bench/sim_accuracy.py.

    python benchmarks/sim_accuracy.py [--rates 1,2] [--requests 60] [--steps] [--floor] [--repeats N]
"""

import sys

from tierserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "sim-accuracy", *sys.argv[1:]]))
