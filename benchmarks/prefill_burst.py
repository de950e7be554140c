"""A burst's prompts prefilled in one step: the lean step's attention with one SDPA call
for each run of fresh chunks of one length (as it runs) against one call per chunk,
alternating in one process on one engine. Prompts take SDPA where the KV cache is int8;
over the bfloat16 cache the engine sends them to the paged kernel
(benchmarks/prefill_attention.py), so here its runner is set to SDPA.

    python benchmarks/prefill_burst.py [--formats gguf,none] [--bursts 4x128,8x64,2x256]
                                       [--rounds 8]

For each weight format, one bfloat16 engine on the default model (SmolLM2-135M); for each
burst NxL, N prompts of L random tokens are added together and the step that prefills
them is timed (the whole `engine.step()`), grouped and per chunk in turn (which goes first
alternating by round), `--rounds`
times each after one warm-up. The outputs are the same bit for bit
(tests/test_lean_step.py). One line per (format, burst): the medians and their ratio.
"""

import argparse
import random
import statistics
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="gguf,none")
    p.add_argument("--bursts", default="4x128,8x64,2x256")
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args(argv)
    try:
        bursts = [tuple(int(v) for v in b.split("x")) for b in args.bursts.split(",")]
        if any(len(b) != 2 or min(b) < 1 for b in bursts):
            raise ValueError
    except ValueError:
        p.error(f"--bursts: expected NxL[,NxL...] with N, L >= 1, got {args.bursts!r}")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    formats = args.formats.split(",")
    if not formats or set(formats) - {"none", "int8", "gguf"}:
        p.error(f"--formats: expected a list of none, int8, gguf, got {args.formats!r}")

    from tierserve.engine.calibrate import cpu_model
    from tierserve.engine.llm_engine import LLMEngine
    from tierserve.llm import engine_config
    from tierserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(0)
    for fmt in formats:
        engine = LLMEngine(engine_config(
            dtype="bfloat16", quantization=fmt, kv_cache_memory_gb=1.0,
            priority_step_time_s=0, enable_prefix_caching=False,
            max_num_batched_tokens=max(n * length for n, length in bursts)))
        if engine.runner.lean is None:
            print(f"prefill_burst: no lean step for {fmt} (no C++ kernels)", file=sys.stderr)
            return 1
        impl = engine.runner.lean.impl
        engine.runner.paged_prefill = False     # the SDPA path whose grouping is measured

        def step_ms(n: int, length: int) -> float:
            for _ in range(n):
                engine.add_request(None, [rng.randrange(100, 40000) for _ in range(length)],
                                   params)
            t = time.perf_counter()
            engine.step()
            took = (time.perf_counter() - t) * 1e3
            while engine.has_unfinished_requests():
                engine.step()
            return took

        for n, length in bursts:
            times = {True: [], False: []}
            for rnd in range(args.rounds + 1):
                for grouped in ((True, False) if rnd % 2 else (False, True)):
                    impl.group_chunks = grouped
                    took = step_ms(n, length)
                    if rnd:                       # round 0 warms both
                        times[grouped].append(took)
            impl.group_chunks = True
            alone, grouped = (statistics.median(times[g]) for g in (False, True))
            print(f"prefill_burst cpu='{cpu_model()}' format={fmt} burst={n}x{length} "
                  f"rounds={args.rounds}: per chunk {alone:.1f} ms, grouped {grouped:.1f} ms, "
                  f"ratio {grouped / alone:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
