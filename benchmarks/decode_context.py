"""Decode step time against context length: what each token of context costs a step
(the decode attention kernel's share, model/cpu_attention.py), at a fixed batch.

    python benchmarks/decode_context.py [--format gguf] [--concurrency 64]
                                        [--contexts 16,128,512] [--steps 8]
                                        [--kv-cache-dtypes auto,int8] [--rounds 3]

For each context length, `concurrency` sequences of that many prompt tokens are brought
into decode on one engine per KV cache dtype, and the engines take turns, `--steps` timed
`engine.step()` calls each per round (side by side, so the machine's drift falls on all
alike); the median is printed per case, then the ratio of each dtype's step to the first's,
then the slope between the shortest and the longest context (ms of step per context token,
all sequences together). One line per figure, config on each.
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
    p.add_argument("--steps", type=int, default=8, help="timed steps per engine per round")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--kv-cache-dtypes", default="auto",
                   help="comma-separated --kv-cache-dtype values, one engine each")
    p.add_argument("--kv-cache-memory-gb", type=float, default=4.0)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args(argv)
    dtypes = args.kv_cache_dtypes.split(",")
    engines = {kv: make_engine(args.format, args, kv_cache_dtype=kv) for kv in dtypes}
    config = (f"format={args.format} concurrency={args.concurrency} "
              f"machine={platform.machine()} cpus={len(os.sched_getaffinity(0))}")
    contexts = [int(c) for c in args.contexts.split(",")]
    times = {kv: {} for kv in dtypes}
    for ctx in contexts:
        ids = {kv: start_decoding(e, args.concurrency, ctx, seed=ctx)
               for kv, e in engines.items()}
        samples = {kv: [] for kv in dtypes}
        for e in engines.values():
            timed_steps(e, 2)  # warm-up
        for _ in range(args.rounds):
            for kv, e in engines.items():
                samples[kv] += timed_steps(e, args.steps)
        for kv in dtypes:
            times[kv][ctx] = statistics.median(samples[kv])
            print(f"decode_context {config} kv_cache_dtype={kv} context={ctx} "
                  f"step_ms={times[kv][ctx] * 1e3:.1f}", flush=True)
        for kv in dtypes[1:]:
            print(f"decode_context {config} context={ctx} step_ratio {kv}/{dtypes[0]}="
                  f"{times[kv][ctx] / times[dtypes[0]][ctx]:.3f}", flush=True)
        for kv, e in engines.items():
            for request_id in ids[kv]:
                e.abort_request(request_id)
            while e.has_unfinished_requests():
                e.step()
    lo, hi = min(contexts), max(contexts)
    if hi > lo:
        for kv in dtypes:
            print(f"decode_context {config} kv_cache_dtype={kv} ms_per_context_token="
                  f"{(times[kv][hi] - times[kv][lo]) / (hi - lo) * 1e3:.3f} "
                  f"(contexts {lo}-{hi})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
