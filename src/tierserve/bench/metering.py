"""Metering benchmarks: its overhead, and what fast mode costs.

`overhead`: the same closed-loop workload (fixed-length prompts and outputs) runs through
one engine in alternating rounds with metering off and on (cost meter, recorder, SQLite
ledger), so machine noise hits both alike; prints each side's output tok/s and the ratio.

`fastmode` (the seed experiment): the same chat requests served (a) all `priority` on an
engine that serves one request at a time (the classic dedicated fast mode), (b) all
`default` batched, (c) 20% priority and the rest default on the tiered shared engine.
Each run is metered with this machine's price; prints cost per 1K output tokens, TTFT p50
and the ratio (a)/(b).
"""

import argparse
import os
import random
import statistics
import tempfile
import time

from tierserve.core.stats import StatsCollector
from tierserve.sampling_params import SamplingParams

QUESTIONS = ["the moon", "bread", "rivers", "chess", "owls", "volcanoes", "tea", "bicycles",
             "glaciers", "violins", "bees", "lighthouses", "deserts", "comets", "maps", "salt",
             "tides", "paper", "copper", "clouds"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=32, help="batched runs' concurrency")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3, help="overhead: off/on round pairs")
    p.add_argument("--price-per-hour", type=float, default=None,
                   help="machine price (default: the cpu-local profile)")
    p.add_argument("--bench-seed", type=int, default=7)


def metered(engine, price: float, ledger_path: str | None):
    from tierserve.metering.ledger import Ledger
    from tierserve.metering.prices import PriceList
    from tierserve.metering.recorder import Recorder

    recorder = Recorder("bench", PriceList(), Ledger(ledger_path) if ledger_path else None)
    recorder.attach(engine, price, 0.0)
    return recorder




def closed_loop(engine, prompts, params, concurrency: int, tiers=None) -> dict:
    collector = StatsCollector()
    engine.add_sink(collector)
    todo = list(enumerate(prompts))
    start = time.perf_counter()
    while todo or engine.has_unfinished_requests():
        while todo and engine.num_unfinished_requests < concurrency:
            i, prompt = todo.pop(0)
            engine.add_request(None, prompt, params, tier=tiers[i] if tiers else "default")
        engine.step()
    wall = time.perf_counter() - start
    engine.remove_sink(collector)
    reqs = collector.requests
    return {"wall_s": wall, "tokens": sum(r.num_output_tokens for r in reqs),
            "tok_s": sum(r.num_output_tokens for r in reqs) / wall,
            "ttft_p50_s": statistics.median(r.ttft_s for r in reqs),
            "machine_cost": sum(r.cost.machine_cost for r in reqs if r.cost is not None),
            "charge": sum(r.charge or 0.0 for r in reqs)}


def run_overhead(args) -> None:
    from tierserve.engine.llm_engine import LLMEngine
    from tierserve.llm import engine_config
    from tierserve.metering.prices import machine_price

    engine = LLMEngine(engine_config(max_num_seqs=args.concurrency))
    price = machine_price("cpu-local", args.price_per_hour)
    rng = random.Random(args.bench_seed)
    prompts = [[rng.randrange(100, engine.shape.vocab_size) for _ in range(128)]
               for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    closed_loop(engine, prompts[:args.concurrency], params, args.concurrency)  # warm-up
    off, on = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            off.append(closed_loop(engine, prompts, params, args.concurrency)["tok_s"])
            recorder = metered(engine, price, os.path.join(tmp, f"l{i}.db"))
            on.append(closed_loop(engine, prompts, params, args.concurrency)["tok_s"])
            recorder.close()
    print(f"metering overhead requests={args.requests} concurrency={args.concurrency} "
          f"prompt=128 output={args.max_tokens} rounds={args.rounds} | off tok/s "
          f"{statistics.median(off):.1f} ({', '.join(f'{x:.1f}' for x in off)}) | on (meter + "
          f"ledger) tok/s {statistics.median(on):.1f} ({', '.join(f'{x:.1f}' for x in on)}) | "
          f"on/off {statistics.median(on) / statistics.median(off):.3f} (target >= 0.97)",
          flush=True)


def run_fastmode(args) -> None:
    from tierserve.engine.llm_engine import LLMEngine
    from tierserve.llm import engine_config
    from tierserve.metering.prices import machine_price

    price = machine_price("cpu-local", args.price_per_hour)
    engine = LLMEngine(engine_config(max_num_seqs=args.concurrency))
    rng = random.Random(args.bench_seed)
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content":
               f"Tell me one fact about {rng.choice(QUESTIONS)}, in one sentence."}])
               for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    mix = ["priority" if rng.random() < 0.2 else "default" for _ in prompts]
    runs = {}
    recorder = metered(engine, price, None)
    runs["(b) all default, batched"] = closed_loop(engine, prompts, params, args.concurrency)
    engine.block_manager.reset_prefix_cache()  # each run starts cold
    runs["(c) 20% priority, tiered shared"] = closed_loop(engine, prompts, params,
                                                          args.concurrency, mix)
    recorder.close()
    fast = LLMEngine(engine_config(max_num_seqs=1, policy="fcfs"))
    recorder = metered(fast, price, None)
    runs["(a) all priority, dedicated fast mode"] = closed_loop(fast, prompts, params, 1)
    recorder.close()
    per_k = {k: 1000 * r["machine_cost"] / r["tokens"] for k, r in runs.items()}
    for name in sorted(runs):
        r = runs[name]
        print(f"fastmode requests={args.requests} max_tokens={args.max_tokens} price=${price}/h "
              f"| {name}: machine ${r['machine_cost']:.6f} for {r['tokens']} output tokens = "
              f"${per_k[name]:.6f} per 1K; TTFT p50 {r['ttft_p50_s'] * 1e3:.0f} ms; "
              f"{r['tok_s']:.1f} tok/s", flush=True)
    a, b = per_k["(a) all priority, dedicated fast mode"], per_k["(b) all default, batched"]
    print(f"fastmode cost per 1K output tokens (a)/(b) = {a / b:.1f}x", flush=True)
