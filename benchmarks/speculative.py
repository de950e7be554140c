"""Speculative decoding by prompt lookup: its gain at few streams and its cost at many
(issue 33), the in-process engine with and without `--speculative-config`, one run.

    python benchmarks/speculative.py [--streams 1,2,4,64] [--requests 8] [--max-tokens 128]
        [--dtype bfloat16] [--quantization gguf] [--temperature 0] [--spec JSON]

The workload copies from its prompts, as the requests speculation is for do: code edits
(a function of this repository with one name changed) and quoting summaries (a section of
the README, its key sentences quoted). A third kind, free prose, drafts little and shows
what speculation costs where it does not help. Each stream count runs closed-loop (that
many requests in flight until `--requests` per stream are done) once without drafts and
once with, in that order, on one engine each, every request in a tier that speculates.
Prints a line per (streams, speculation) with output tok/s, time per output token after
the first (p50 and p90 over requests), the accepted fraction of drafts and the steps
taken, then one summary line with the config and the ratios.
"""

import argparse
import glob
import os
import re
import statistics
import sys
import time

from tierserve.engine.calibrate import cpu_model
from tierserve.engine.llm_engine import LLMEngine
from tierserve.llm import engine_config
from tierserve.sampling_params import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def prompts() -> list[tuple[str, str]]:
    """(kind, user message), a fixed set drawn from this repository's files."""
    out = []
    sources = sorted(glob.glob(os.path.join(ROOT, "src/tierserve/core/*.py")))
    for path in sources[:6]:
        text = open(path).read()
        funcs = re.findall(r"\n(    def [a-z_]+\(self[^\n]*\n(?:        [^\n]*\n|\n){3,14})", text)
        if not funcs:
            continue
        body = funcs[len(funcs) // 2]
        name = re.match(r"    def ([a-z_]+)", body).group(1)
        out.append(("code", f"Rename the method `{name}` to `{name}_v2` in this code and "
                            f"output the whole code, changed, with nothing else:\n\n{body}"))
    readme = open(os.path.join(ROOT, "README.md")).read()
    sections = [s for s in readme.split("\n## ")[1:] if 400 < len(s) < 2500][:4]
    for s in sections:
        out.append(("quote", "Summarize this section in three sentences, quoting its key "
                             f"sentences word for word:\n\n{s[:1500]}"))
    for topic in ("a lighthouse keeper", "a city garden", "a long train journey"):
        out.append(("prose", f"Write a short story about {topic}."))
    return out


def run(engine: LLMEngine, work: list[str], streams: int, total: int,
        params: SamplingParams) -> dict:
    queue = [work[i % len(work)] for i in range(total)]
    steps, done, started = 0, [], time.perf_counter()
    while queue or engine.has_unfinished_requests():
        while queue and engine.num_unfinished_requests < streams:
            engine.add_request(None, queue.pop(0), params)
        for out in engine.step():
            if out.finished:
                done.append(out.metrics)
        steps += 1
    wall = time.perf_counter() - started
    tokens = sum(s.num_output_tokens for s in done)
    tpots = [(s.token_times[-1] - s.token_times[0]) / (len(s.token_times) - 1)
             for s in done if len(s.token_times) > 1]
    qs = statistics.quantiles(tpots, n=10) if len(tpots) > 1 else tpots * 9
    return {"tok_s": tokens / wall, "tpot_p50_ms": 1e3 * statistics.median(tpots),
            "tpot_p90_ms": 1e3 * qs[-1], "steps": steps, "tokens": tokens}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", default="1,2,4,64")
    p.add_argument("--requests", type=int, default=8, help="requests per stream count "
                   "at one stream; at s streams, max(requests, 2 s)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default="gguf")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--kinds", default="code,quote,prose")
    p.add_argument("--spec", default='{"method": "ngram", "tiers": ["default"]}',
                   help="the --speculative-config of the run with drafts")
    args = p.parse_args(argv)
    streams = [int(s) for s in args.streams.split(",")]
    kinds = set(args.kinds.split(","))
    base = dict(dtype=args.dtype, quantization=args.quantization, priority_step_time_s=0)
    engines = {False: LLMEngine(engine_config(**base)),
               True: LLMEngine(engine_config(**base, speculative_config=args.spec))}
    tok = engines[False].tokenizer
    work = [tok.apply_chat_template([{"role": "user", "content": m}])
            for kind, m in prompts() if kind in kinds]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            ignore_eos=False)
    for engine in engines.values():          # warm both (first steps, kernels, caches)
        run(engine, work[:2], 2, 2, SamplingParams(max_tokens=8))
    results = {}
    for s in streams:
        total = max(args.requests, 2 * s)
        for spec, engine in engines.items():
            sched = engine.scheduler
            drafts0, kept0 = sum(sched.num_draft_tokens.values()), \
                sum(sched.num_accepted_tokens.values())
            r = run(engine, work, s, total, params)
            drafts = sum(sched.num_draft_tokens.values()) - drafts0
            kept = sum(sched.num_accepted_tokens.values()) - kept0
            r["accepted"] = kept / drafts if drafts else 0.0
            r["drafts"] = drafts
            results[(s, spec)] = r
            print(f"speculative streams={s} spec={'on' if spec else 'off'} requests={total} "
                  f"tok_s={r['tok_s']:.1f} tpot_p50_ms={r['tpot_p50_ms']:.2f} "
                  f"tpot_p90_ms={r['tpot_p90_ms']:.2f} steps={r['steps']} "
                  f"tokens={r['tokens']} drafts={drafts} accepted={r['accepted']:.2f}",
                  flush=True)
    ratios = " ".join(f"x{s}={results[(s, True)]['tok_s'] / results[(s, False)]['tok_s']:.2f}"
                      for s in streams)
    print(f"speculative cpu={cpu_model()!r} dtype={args.dtype} quantization={args.quantization} "
          f"max_tokens={args.max_tokens} temperature={args.temperature} kinds={args.kinds} "
          f"spec={args.spec} tok_s_ratio {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
