"""Batch jobs on `tierserve serve`: batch output tok/s when the server is otherwise idle,
as a share of the offline engine's; priority TTFT p50/p99 with and without a batch.

    python benchmarks/batch.py [--lines 96] [--output-len 128] [--max-num-seqs 16]

Same flags as `tierserve bench batch`. Prints one line with its config and the figures.
"""

import sys

from tierserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "batch", *sys.argv[1:]]))
