"""Chaos: SIGKILL `tierserve serve` mid-stream, mid-batch, mid-commit or mid-migration,
restart it, and check the ledger and the batch store: integrity, every batch line recorded
and charged once, no request charged twice, every answered request in the ledger.

    python benchmarks/chaos.py [--rounds 20] [--bench-seed 4321] [--max-num-seqs 16]

Engine flags as `tierserve serve` takes them. Prints a line per round (what broke) and a
final line with its config and the number of rounds with an invariant broken.
"""

import sys

from tierserve.bench.chaos import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
