"""The fleet twin against a real fleet: see src/tierserve/bench/fleet_twin.py.

    python benchmarks/fleet_twin.py [--fleet tierserve|vllm|vllm-plugin|both] [--rate 1.5]
        [--requests 120] [--profile steps|grid]
"""

import sys

from tierserve.bench.fleet_twin import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
