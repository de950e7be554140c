"""Float32 linear layers packed by oneDNN against torch's `F.linear`, side by side in one run.

    python benchmarks/linear_pack.py [--concurrency 1,2,3,4,8,16,64] [--rounds 5] [--steps 4]
                                     [--rows 1,2,3,4,16,64]

Where oneDNN packs no bfloat16 (an AVX2-only CPU), an unquantized model computes in float32
and tierserve packs its float32 weights (model/cpu_linear.py). This measures that choice
on the machine at hand, whatever it would choose:
- `linear`: SmolLM2-135M's linear shapes (576 -> 960 qkv, 576 -> 576, 576 -> 3072,
  1536 -> 576, the 576 -> 49152 head) at `--rows` rows, milliseconds per call, the two
  ways taking turns;
- `decode`: two float32 engines on the default model, one packed and one not, each holding
  `c` sequences of 128 prompt tokens in decode; they take turns, `--steps` timed engine
  steps each per round, so a noisy neighbour hits both alike; then a 512-token prefill.
One line per case, with the CPU model.
"""

import argparse
import statistics
import sys
import time

from quant_speed import decode_times, prefill_times

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152))


def linear_line(k: int, n: int, rows: int, rounds: int) -> str:
    import torch
    import torch.nn.functional as F

    w = torch.randn(n, k)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
    x = torch.randn(rows, k)
    ways = {"F.linear": lambda: F.linear(x, w),
            "packed": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")}
    times = {name: [] for name in ways}
    calls = max(3, int(2e8 // (n * k * 4)))             # about 0.2 GB of weight reads
    for name, fn in ways.items():
        fn()                                            # warm
    for _ in range(rounds):
        for name, fn in ways.items():
            begin = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - begin) / calls * 1e3)
    ms = {name: statistics.median(t) for name, t in times.items()}
    return (f"linear {k}->{n} rows={rows} | ms per call F.linear {ms['F.linear']:.3f} "
            f"packed {ms['packed']:.3f} ({ms['F.linear'] / ms['packed']:.2f}x)")


def make_engine(packed: bool, seqs: int):
    from unittest import mock

    from tierserve.engine.llm_engine import LLMEngine
    from tierserve.llm import engine_config
    from tierserve.model import cpu_linear

    config = engine_config(dtype="float32", quantization="none", max_num_seqs=seqs,
                           priority_step_time_s=0, enable_prefix_caching=False)
    with mock.patch.object(cpu_linear, "packs_float32", lambda: packed):
        engine = LLMEngine(config)
    assert isinstance(engine.runner.model.lm_head, cpu_linear.PackedLinear) == packed
    return engine


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,2,3,4,8,16,64")
    p.add_argument("--rows", default="1,2,3,4,16,64")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4, help="timed steps per engine per round")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    import torch

    from tierserve.engine.calibrate import cpu_model
    from tierserve.model.cpu_linear import packs_float32

    print(f"# cpu={cpu_model()!r} threads={torch.get_num_threads()} torch={torch.__version__} "
          f"packs_float32={packs_float32()} rounds={args.rounds} steps={args.steps}",
          flush=True)
    for k, n in SHAPES:
        for rows in (int(r) for r in args.rows.split(",")):
            print(linear_line(k, n, rows, args.rounds), flush=True)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    engines = {"F.linear": make_engine(False, max(concurrency)),
               "packed": make_engine(True, max(concurrency))}
    for c in concurrency:
        t = decode_times(engines, c, args.rounds, args.steps, args.seed)
        print(f"decode float32 c={c} | step ms F.linear {t['F.linear'] * 1e3:.1f} packed "
              f"{t['packed'] * 1e3:.1f} ({t['F.linear'] / t['packed']:.2f}x)", flush=True)
    t = prefill_times(engines, args.rounds, args.seed)
    print(f"prefill float32 tokens=512 | ms F.linear {t['F.linear'] * 1e3:.1f} packed "
          f"{t['packed'] * 1e3:.1f} ({t['F.linear'] / t['packed']:.2f}x)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
