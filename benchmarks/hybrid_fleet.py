"""The hybrid plan at fleet scale: a gateway over a small pool and a large pool, the
workload of benchmarks/hybrid.py served (a) all-large fast lane, (b) all-large shared,
(c) rules, (d) the learned router, (e) a shuffled control with (d)'s share.

    python benchmarks/hybrid_fleet.py [--conversations 40] [--rate 0.4] [--max-tokens 16]

Prints one JSON line per run and one summary line with its config.
"""

import sys

from tierserve.bench.hybrid_fleet import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
