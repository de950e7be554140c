"""Decode step time against context length: what each token of context costs a step
(the decode attention kernel's share, model/cpu_attention.py), at a fixed batch.

    python benchmarks/decode_context.py [--format gguf] [--concurrency 64]
                                        [--contexts 16,128,512] [--steps 8]

For each context length, `concurrency` sequences of that many prompt tokens are brought
into decode on one engine and the median of `--steps` timed `engine.step()` calls is
printed; the last line is the slope between the shortest and the longest context (ms of
step per context token, all sequences together). One line per case, config on each.
"""

import argparse
import os
import platform
import statistics
import sys

from quant_speed import make_engine, start_decoding, timed_steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--format", default="gguf", help="weight format (--quantization)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--contexts", default="16,128,512")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--kv-cache-memory-gb", type=float, default=4.0)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args(argv)
    engine = make_engine(args.format, args)
    config = (f"format={args.format} concurrency={args.concurrency} "
              f"machine={platform.machine()} cpus={len(os.sched_getaffinity(0))}")
    times = {}
    for ctx in (int(c) for c in args.contexts.split(",")):
        ids = start_decoding(engine, args.concurrency, ctx, seed=ctx)
        timed_steps(engine, 2)  # warm-up
        times[ctx] = statistics.median(timed_steps(engine, args.steps))
        print(f"decode_context {config} context={ctx} step_ms={times[ctx] * 1e3:.1f}",
              flush=True)
        for request_id in ids:
            engine.abort_request(request_id)
        while engine.has_unfinished_requests():
            engine.step()
    lo, hi = min(times), max(times)
    if hi > lo:
        print(f"decode_context {config} ms_per_context_token="
              f"{(times[hi] - times[lo]) / (hi - lo) * 1e3:.3f} (contexts {lo}-{hi})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
