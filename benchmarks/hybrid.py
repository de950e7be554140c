"""Hybrid serving against all-large-fast: cost per 1,000 conversations from the ledger,
simple-turn TTFT, routing accuracy (rules and the trained classifier).

    python benchmarks/hybrid.py [--conversations 40] [--rate 0.4] [--max-tokens 16]
                                [--small-quantization gguf]

Prints one JSON line per run and one summary line with its config.
"""

import sys

from tierserve.bench.hybrid import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
