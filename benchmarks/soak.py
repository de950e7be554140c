"""Soak: `tierserve serve` under a mix of tiers, streams, dropped streams and batch jobs for
`--minutes`, on loopback; RSS growth, KV blocks held when idle, p99 drift, and the ledger
against the responses.

    python benchmarks/soak.py [--minutes 30] [--concurrency 4] [--max-num-seqs 16]

Engine flags as `tierserve serve` takes them. Prints one line with its config and the
figures (detail lines before it).
"""

import sys

from tierserve.bench.soak import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
