"""Random sampling: torch's path against the CPU kernel (model/cpu_sample.py), on the real
model's logits, and whole decode steps with each beside greedy ones, side by side.

    python benchmarks/sample_kernel.py [--streams 16] [--tokens 24] [--rounds 3]
        [--quantization gguf] [--sampling 1,1 --sampling 0.2,0.9] [--rev REV]

For each `--sampling TEMPERATURE,TOP_P`: the rows the sampler is given in `--streams`
decode steps are recorded, then each recorded call is timed with both paths (ms per call,
median), and the decode steps of `--streams` requests are timed with torch's path, the
kernel and greedy decoding, alternating `--rounds` times so drift falls on all alike.
Prints one line per setting: the config, ms per call each way, the median decode step
each way, and sampling's cost over a greedy step. With `--rev`, the kernel as git REV
holds it (compiled beside the working tree's, as benchmarks/kernel_ab.py does) is a third
path in both, for a before/after in one run.
"""

import argparse
import statistics
import sys
import time

from sampler import decode_steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quantization", default="gguf", help="as `make serve` (none: bf16)")
    ap.add_argument("--sampling", action="append", default=None, metavar="T,TOP_P",
                    help="temperature and top_p, repeatable (default: 1,1 and 0.2,0.9: "
                         "OpenAI's defaults and SmolLM2's)")
    ap.add_argument("--rev", default=None,
                    help="also time the sampling kernel as this git revision holds it")
    args = ap.parse_args()

    import torch

    from tierserve.engine.calibrate import cpu_model
    from tierserve.engine.llm_engine import LLMEngine
    from tierserve.llm import engine_config
    from tierserve.model import kernels
    from tierserve.sampling_params import SamplingParams
    from tierserve.worker import sampler

    if kernels.load() is None:
        print("sample_kernel: no C++ kernels here", file=sys.stderr)
        return 1
    engine = LLMEngine(engine_config(
        quantization=None if args.quantization == "none" else args.quantization,
        max_num_seqs=max(args.streams, 1)))
    with_kernel = sampler._sample_random

    def torch_only(logits, states):
        u = torch.tensor([1.0 - torch.rand(1, generator=s.generator).item() for s in states])
        return sampler._sample_torch(logits, [s.params for s in states], u)

    paths = {"torch": torch_only, "kernel": with_kernel}
    if args.rev:
        from kernel_ab import build, source_at

        before = build(source_at(args.rev))

        def at_rev(logits, states):
            saved, kernels._KERNEL = kernels._KERNEL, before
            try:
                return with_kernel(logits, states)
            finally:
                kernels._KERNEL = saved
        paths[f"kernel@{args.rev}"] = at_rev

    greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    for setting in args.sampling or ["1,1", "0.2,0.9"]:
        t, p = (float(x) for x in setting.split(","))
        params = SamplingParams(temperature=t, top_p=p, max_tokens=args.tokens,
                                ignore_eos=True, seed=0)
        recorded = []

        def recording(logits, states):
            recorded.append((logits.clone(), states))
            return with_kernel(logits, states)

        sampler._sample_random = recording
        decode_steps(engine, params, args.streams, args.tokens)  # warm-up, and the rows
        steps = {name: [] for name in (*paths, "greedy")}
        for _ in range(args.rounds):
            for name, fn in paths.items():
                sampler._sample_random = fn
                steps[name] += decode_steps(engine, params, args.streams, args.tokens)
            steps["greedy"] += decode_steps(engine, greedy, args.streams, args.tokens)
        sampler._sample_random = with_kernel
        ms = {name: [] for name in paths}
        for logits, states in recorded:
            for name, fn in paths.items():
                begin = time.perf_counter()
                fn(logits.clone(), states)
                ms[name].append((time.perf_counter() - begin) * 1e3)
        call = {k: statistics.median(v) for k, v in ms.items()}
        step = {k: statistics.median(v) * 1e3 for k, v in steps.items()}
        calls = ", ".join(f"{k} {v:.3f}" for k, v in call.items())
        ratios = ", ".join(f"{k} {call['torch'] / v:.1f}x" for k, v in call.items()
                           if k != "torch")
        steps_ms = ", ".join(f"{k} {v:.2f} ms" for k, v in step.items())
        over = ", ".join(f"{k} {v / step['greedy'] - 1:+.1%}" for k, v in step.items()
                         if k != "greedy")
        print(f"sample_kernel cpu={cpu_model()!r} quantization={args.quantization} "
              f"streams={args.streams} temperature={t:g} top_p={p:g} calls={len(recorded)} "
              f"rows={recorded[-1][0].shape[0] if recorded else 0} | ms per call {calls} "
              f"(torch's over each: {ratios}) | decode step median {steps_ms} (sampling's "
              f"cost over greedy: {over})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
