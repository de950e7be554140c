"""Prefill chunks' attention in the lean step: the paged kernel (each position a query over
its own context, as the engine runs it) against torch's SDPA, in one engine, alternating.

    python benchmarks/prefill_attention.py [--quantization gguf] [--lengths 32,128,512]
                                           [--burst 4] [--rounds 5] [--concurrency 64]
                                           [--requests 128] [--loops 2]

Lone prefills of each of `--lengths` tokens (one request, one output token) and a burst of
`--burst` 128-token prompts, the two paths alternating `--rounds` times: the median time of
each (a prompt longer than the step's token budget, 512 here, is prefilled in chunks that
continue cached context). Then a closed loop of `--requests` requests (128-token prompts of
random ids, 128 output tokens, EOS ignored) at `--concurrency`, each path `--loops` times
in alternation: output tok/s. Prefix caching and the step-time cap are off, so both paths
compute and schedule alike. One line per case with the config.
"""

import argparse
import random
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quantization", default="gguf", choices=("gguf", "int8", "none"),
                    help="as `make serve` (none: bf16)")
    ap.add_argument("--lengths", default="32,128,512")
    ap.add_argument("--burst", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--loops", type=int, default=2)
    args = ap.parse_args()
    try:
        lengths = [int(n) for n in args.lengths.split(",")]
    except ValueError:
        ap.error(f"--lengths takes token counts separated by commas, not {args.lengths!r}")
    if min(lengths) < 1 or min(args.burst, args.rounds, args.concurrency, args.requests,
                               args.loops) < 1:
        ap.error("--lengths, --burst, --rounds, --concurrency, --requests and --loops must "
                 "be at least 1")

    from tierserve.engine.calibrate import cpu_model
    from tierserve.engine.llm_engine import LLMEngine
    from tierserve.llm import engine_config
    from tierserve.sampling_params import SamplingParams

    engine = LLMEngine(engine_config(
        quantization=None if args.quantization == "none" else args.quantization,
        max_num_seqs=max(args.concurrency, args.burst), priority_step_time_s=0,
        enable_prefix_caching=False))
    runner = engine.runner
    if max(lengths) >= engine.max_model_len:
        ap.error(f"--lengths: at most {engine.max_model_len - 1} tokens (the model's context "
                 f"less one output token), not {max(lengths)}")
    if not runner.paged_prefill:
        print("prefill_attention: this engine has no lean step with the paged prefill "
              "(no C++ kernels here, or an int8 KV cache)", file=sys.stderr)
        return 1
    rng = random.Random(0)
    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, engine.shape.vocab_size) for _ in range(n)]

    def prefill(paged: bool, prompts: list[list[int]]) -> float:
        runner.paged_prefill = paged
        for p in prompts:
            engine.add_request(None, p, one)
        begin = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - begin

    def closed_loop(paged: bool) -> float:
        runner.paged_prefill = paged
        params = SamplingParams(max_tokens=128, ignore_eos=True)
        left = args.requests
        for _ in range(min(args.concurrency, left)):
            engine.add_request(None, prompt(128), params)
            left -= 1
        begin, tokens = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += len(out.delta_token_ids)
                if out.finished and left:
                    engine.add_request(None, prompt(128), params)
                    left -= 1
        return tokens / (time.perf_counter() - begin)

    cases = [(f"prefill_{n}", [n]) for n in lengths] + [(f"burst_{args.burst}x128",
                                                         [128] * args.burst)]
    for paged in (True, False):                    # warm both paths
        prefill(paged, [prompt(n) for n in (32, 128)])
    config = f"cpu='{cpu_model()}' quantization={args.quantization}"
    for name, sizes in cases:
        times = {True: [], False: []}
        for r in range(args.rounds):
            for paged in ((True, False) if r % 2 else (False, True)):
                times[paged].append(prefill(paged, [prompt(n) for n in sizes]))
        paged_ms, sdpa_ms = (statistics.median(times[k]) * 1e3 for k in (True, False))
        print(f"prefill_attention {config} rounds={args.rounds} case={name} | ms paged "
              f"{paged_ms:.1f} sdpa "
              f"{sdpa_ms:.1f} paged/sdpa {paged_ms / sdpa_ms:.3f}", flush=True)
    rates = {True: [], False: []}
    for r in range(args.loops):
        for paged in ((True, False) if r % 2 else (False, True)):
            rates[paged].append(closed_loop(paged))
    paged_tps, sdpa_tps = (statistics.median(rates[k]) for k in (True, False))
    print(f"prefill_attention {config} case=closed_loop concurrency={args.concurrency} "
          f"requests={args.requests} prompt=128 output=128 loops={args.loops} | tok/s paged "
          f"{paged_tps:.1f} ({', '.join(f'{v:.1f}' for v in rates[True])}) sdpa "
          f"{sdpa_tps:.1f} ({', '.join(f'{v:.1f}' for v in rates[False])}) paged/sdpa "
          f"{paged_tps / sdpa_tps:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
