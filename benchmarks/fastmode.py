"""`tierserve bench fastmode` as a script (same flags); see src/tierserve/bench/metering.py.

    python benchmarks/fastmode.py [--requests 200] [--concurrency 32] [--max-tokens 48]
"""

import sys

from tierserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "fastmode", *sys.argv[1:]]))
