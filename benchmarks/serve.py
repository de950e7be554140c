"""Streaming HTTP load against `tierserve serve` at concurrency 1/4/16/64, and the ratio
of HTTP to offline engine throughput at 16.

    python benchmarks/serve.py [--dtype bfloat16] [--concurrency 1,4,16,64] [--url URL]

Same flags as `tierserve bench serve`. Prints one line per configuration.
"""

import sys

from tierserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "serve", *sys.argv[1:]]))
