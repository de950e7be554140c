"""Two tenants in one tier: does one tenant's burst starve the other's trickle?

    tierserve bench tiers --two-tenants [--burst 100] [--ratio 10] [--max-num-seqs 8]

NOTE: what runs
    One engine (the default model, the tiered policy), the default tier only. Tenant A
    sends `burst` requests at once; B sends burst/ratio just after (a 10:1 burst), all of
    one shape (a prompt of `prompt_tokens`, `max_tokens` output, EOS ignored). The same
    workload runs twice, side by side in one process:
      tenants   each request carries its tenant (the scheduler's fair queue);
      fifo      the same requests without tenants: one flow, arrival order within the
                tier (what the scheduler did before fair shares).
    Throughput is output tokens per second per tenant over the window both tenants had
    work waiting (from the start until B's last request got its first token; after that B
    asks for less than a fair share, and max-min fairness gives A the rest): Jain's
    fairness index of the two is 1.0 when they got equal shares, 0.5 when one got all.
    B needs more requests than half the slots for the window to mean anything, hence the
    default 400:40 at 32 slots. Also B's
    TTFT p50 and the total throughput of each run (fairness should not cost throughput).
"""

import argparse
import os
import platform
import statistics
import time

from tierserve.core.request import Owner


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--two-tenants", action="store_true",
                   help="run the two-tenant fairness check instead of the tier sweep")
    p.add_argument("--burst", type=int, default=400, help="tenant A's requests (default 400)")
    p.add_argument("--ratio", type=int, default=10, help="A's requests per B's (default 10)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else 1.0


def run_once(engine, args, with_tenants: bool) -> dict:
    from tierserve.core.stats import StatsCollector
    from tierserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True, temperature=0)
    collector = StatsCollector()
    engine.add_sink(collector)
    tenant_of = {}
    for tenant, n in (("a", args.burst), ("b", max(1, args.burst // args.ratio))):
        for i in range(n):
            prompt = [1] + [(hash((tenant, i, j)) % 40000) + 100
                            for j in range(args.prompt_tokens - 1)]
            owner = Owner(tenant) if with_tenants else None
            rid = engine.add_request(None, prompt, params, tier="default", owner=owner)
            tenant_of[rid] = tenant
    start = time.perf_counter()
    token_times = {"a": [], "b": []}
    ttft_b, b_started = [], 0.0
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter() - start
            tenant = tenant_of[out.request_id]
            if tenant == "b" and len(out.outputs[0].token_ids) == len(out.delta_token_ids):
                b_started = now  # its first token: B had waiting work until now
            token_times[tenant] += [now] * len(out.delta_token_ids)
            if out.finished and tenant == "b":
                ttft_b.append(out.metrics.ttft_s)
    wall = time.perf_counter() - start
    engine.remove_sink(collector)
    engine.block_manager.reset_prefix_cache()
    window = b_started
    rates = [sum(t <= window for t in token_times[x]) / window for x in ("a", "b")]
    total = sum(len(v) for v in token_times.values())
    return {"jain": jain(rates), "tok_s_a": rates[0], "tok_s_b": rates[1],
            "window_s": window, "b_ttft_p50_s": statistics.median(ttft_b),
            "total_tok_s": total / wall}


def run(args) -> None:
    from tierserve.engine.llm_engine import LLMEngine
    from tierserve.llm import engine_config

    engine = LLMEngine(engine_config(dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                                     policy="tiered", priority_step_time_s=0))
    run_once(engine, argparse.Namespace(**{**vars(args), "burst": 8}), True)  # warm up
    results = {name: run_once(engine, args, name == "tenants") for name in ("fifo", "tenants")}
    for name, r in results.items():
        print(f"  {name:8s} jain {r['jain']:.3f}  tok/s A {r['tok_s_a']:.1f} B "
              f"{r['tok_s_b']:.1f} over {r['window_s']:.1f} s  B TTFT p50 "
              f"{r['b_ttft_p50_s']:.2f} s  total {r['total_tok_s']:.1f} tok/s")
    fair, fifo = results["tenants"], results["fifo"]
    print(f"fairness: machine={platform.machine()} cpus={os.cpu_count()} dtype={args.dtype} "
          f"max_num_seqs={args.max_num_seqs} burst={args.burst}:{args.burst // args.ratio} "
          f"prompt={args.prompt_tokens} output={args.output_tokens} | jain tenants "
          f"{fair['jain']:.3f} vs fifo {fifo['jain']:.3f} (target >= 0.9); B TTFT p50 "
          f"{fair['b_ttft_p50_s']:.2f} s vs {fifo['b_ttft_p50_s']:.2f} s; throughput ratio "
          f"{fair['total_tok_s'] / fifo['total_tok_s']:.3f}")
