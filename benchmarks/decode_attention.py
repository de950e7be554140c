"""The paged decode attention kernel alone, bf16 cache against the 8-bit one
(`--kv-cache-dtype int8`), side by side in one process.

    python benchmarks/decode_attention.py [--contexts 190,512] [--sequences 64]
                                          [--layers 30] [--rounds 3] [--calls 5]

SmolLM2-135M's attention shape (9 query heads, 3 KV heads of 64). For each context
length, `--sequences` sequences of that many tokens, each layer's blocks its own (caches
`--layers` deep, so a step's reads come from memory, not cache), random values; block
tables either consecutive (as the engine allocates a fresh pool) or shuffled. One timed
"step" calls the kernel once per layer; the median of `--calls` steps per round, rounds
alternating between the formats. One line per case: milliseconds per step, nanoseconds
per position and KV head, and the int8 / bf16 ratio.
"""

import argparse
import os
import platform
import statistics
import sys
import time

import torch

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="190,512")
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=5)
    args = p.parse_args(argv)
    from tierserve.model import cpu_attention, kernels

    kernel = kernels.load()
    if kernel is None:
        print("decode_attention: needs the CPU kernels (a C++ toolchain)", file=sys.stderr)
        return 1
    gen = torch.Generator().manual_seed(0)
    B, layers = args.sequences, args.layers
    config = (f"sequences={B} layers={layers} heads={HEADS}/{KV_HEADS}x{DIM} "
              f"machine={platform.machine()} cpus={len(os.sched_getaffinity(0))}")
    for L in (int(c) for c in args.contexts.split(",")):
        width = -(-L // BLOCK)
        blocks = B * width * layers
        x = torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=gen)
        y = torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=gen)
        caches = {"bf16": (x.bfloat16(), y.bfloat16())}
        ks, vs = x.abs().amax(-1) / 127, y.abs().amax(-1) / 127
        caches["int8"] = (torch.round(x / ks[..., None]).to(torch.int8),
                          torch.round(y / vs[..., None]).to(torch.int8), ks, vs)
        del x, y
        lens = torch.full((B,), L, dtype=torch.long)
        q = torch.randn(B, HEADS, DIM, generator=gen).bfloat16()
        for order in ("consecutive", "shuffled"):
            ids = torch.arange(blocks) if order == "consecutive" else \
                torch.randperm(blocks, generator=gen)
            tables = ids.view(layers, B, width).contiguous()

            def step(fmt):
                t = time.perf_counter()
                for layer in range(layers):
                    cpu_attention.paged_decode(kernel, q, *caches[fmt][:2], tables[layer], lens,
                                               *caches[fmt][2:])
                return time.perf_counter() - t

            times = {fmt: [] for fmt in caches}
            for _ in range(args.rounds):
                for fmt in caches:
                    times[fmt].append(statistics.median(step(fmt) for _ in range(args.calls)))
            ms = {fmt: statistics.median(t) * 1e3 for fmt, t in times.items()}
            per = {fmt: ms[fmt] * 1e6 / (B * L * layers * KV_HEADS) for fmt in ms}
            print(f"decode_attention {config} context={L} tables={order} "
                  f"bf16_ms={ms['bf16']:.2f} int8_ms={ms['int8']:.2f} "
                  f"ns_per_position_head bf16={per['bf16']:.2f} int8={per['int8']:.2f} "
                  f"ratio={ms['int8'] / ms['bf16']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
