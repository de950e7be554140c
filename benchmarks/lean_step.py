"""What the lean step (model/cpu_step.py) gains: engine step time with the forward pass in
Python (torch ops per layer) and in one C++ call, side by side on the same engine.

    python benchmarks/lean_step.py [--formats none,gguf] [--concurrency 1,4,16,64]
                                   [--rounds 5] [--steps 4]

For each weight format, one bfloat16 engine on the default model (SmolLM2-135M) holds `c`
sequences of 128 prompt tokens in decode; the two paths take turns, `--steps` timed
`engine.step()` calls each per round (the whole step: scheduling, forward, sampling), so a
noisy neighbour hits both alike. Prints the median step per path and the ratio, then a
512-token prefill step the same way. One line per (format, case).
"""

import argparse
import platform
import random
import statistics
import sys

from quant_speed import make_engine, start_decoding, timed_steps


def paths(engine):
    return {"python": None, "lean": engine.runner.lean}


def decode(engine, c: int, rounds: int, steps: int, seed: int) -> dict:
    ids = start_decoding(engine, c, 128, seed)
    times = {name: [] for name in paths(engine)}
    options = paths(engine)
    for name, lean in options.items():             # warm both
        engine.runner.lean = lean
        timed_steps(engine, 2)
    for _ in range(rounds):
        for name, lean in options.items():
            engine.runner.lean = lean
            times[name] += timed_steps(engine, steps)
    engine.runner.lean = options["lean"]
    for rid in ids:
        engine.abort_request(rid)
    return {name: statistics.median(t) for name, t in times.items()}


def prefill(engine, rounds: int, seed: int) -> dict:
    from tierserve.sampling_params import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    options = paths(engine)
    times = {name: [] for name in options}
    for _ in range(rounds):
        prompt = [rng.randrange(100, 40000) for _ in range(512)]
        for name, lean in options.items():
            engine.runner.lean = lean
            engine.add_request(None, list(prompt), params)
            times[name] += timed_steps(engine, 1)
            while engine.has_unfinished_requests():
                engine.step()
    engine.runner.lean = options["lean"]
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="none,gguf")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4, help="timed steps per path per round")
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    import torch

    print(f"# lean_step machine={platform.machine()} threads={torch.get_num_threads()} "
          f"torch={torch.__version__} dtype=bfloat16 rounds={args.rounds} steps={args.steps} "
          f"seed={args.seed}", flush=True)
    for fmt in args.formats.split(","):
        engine = make_engine(fmt, args)
        if engine.runner.lean is None:
            print(f"lean format={fmt}: no lean step here (no kernels, or a model it does "
                  f"not cover)")
            continue
        for c in (int(x) for x in args.concurrency.split(",")):
            t = decode(engine, c, args.rounds, args.steps, args.seed + c)
            print(f"lean format={fmt} decode concurrency={c} prompt=128 | python "
                  f"{t['python'] * 1e3:.1f} ms | lean {t['lean'] * 1e3:.1f} ms "
                  f"({t['python'] / t['lean']:.2f}x)", flush=True)
        t = prefill(engine, max(2, args.rounds // 2), args.seed)
        print(f"lean format={fmt} prefill 512 tokens | python {t['python'] * 1e3:.0f} ms | "
              f"lean {t['lean'] * 1e3:.0f} ms ({t['python'] / t['lean']:.2f}x)", flush=True)
        del engine
    return 0


if __name__ == "__main__":
    sys.exit(main())
