"""Offline engine throughput at concurrency 1/4/16/64 beside transformers `generate`.

    python benchmarks/throughput.py [--dtype bfloat16] [--concurrency 1,4,16,64] [--no-hf]

Same flags as `tierserve bench throughput`. Prints one line per configuration.
"""

import sys

from tierserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "throughput", *sys.argv[1:]]))
