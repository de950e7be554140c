"""Service tiers under open-loop load: FCFS, strict priority, tierserve shared, silos.

NOTE: what runs
    A seeded Poisson stream of requests mixing tiers (default: 20% priority short chats,
    50% default and 30% flex longer work) is replayed at rising request rates through the
    real engine on the default model, one policy at a time, each in its own process:
      fcfs       one engine, arrival order (tiers ignored);
      priority   one engine, vLLM-style strict priority;
      tiered     one engine, tierserve's tier policy (shared deployment);
      dedicated  two engines, one core each (torch threads 1, pinned): priority requests
                 alone on one with a small max_num_seqs, the rest on the other (the
                 classic "fast mode" silo beside a batching endpoint).
    Before that, a calibration run fits the step-time model on this machine and measures
    an idle engine's TTFT for a priority and a default prompt; the SLOs are multiples of
    those figures (`slo_multiples`), printed with the results.

    The driver is open-loop: a request is added to the engine at its arrival time (or,
    if a step is running then, right after it: a server would see the same), and its
    arrival time is the scheduled one, so queueing behind a step counts in its TTFT.
"""

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from tierserve.tiers import Tier

TIER_NAMES = tuple(t.label for t in Tier if t != Tier.BATCH)
SLO_MULTIPLES = {
    # tier: (x idle TTFT of the tier's prompt, x a lone decode step for TPOT)
    "priority": (2.5, 3.0),
    "default": (10.0, 6.0),
    "flex": (40.0, 12.0),
}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rates", default="1,2,3,4", help="request rates in req/s (default 1,2,3,4)")
    p.add_argument("--requests", type=int, default=100, help="requests per rate (default 100)")
    p.add_argument("--policies", default="fcfs,priority,tiered,dedicated")
    p.add_argument("--priority-share", type=float, default=0.2)
    p.add_argument("--flex-share", type=float, default=0.3)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--dedicated-max-num-seqs", type=int, default=4,
                   help="slots of the priority silo (default 4)")
    p.add_argument("--cap-fraction", type=float, default=0.9,
                   help="tiered step-time cap as a fraction of the priority TPOT SLO")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--bench-seed", type=int, default=2026)
    p.add_argument("--json", default=None, help="also write every figure to this file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)


# ------------------------------------------------------------------ workload
@dataclass
class Arrival:
    t: float
    tier: str
    prompt: list[int]
    max_tokens: int


SYSTEM_PROMPT = [1, *range(900, 931)]  # a shared 32-token prefix, as chat apps have


def make_workload(rate: float, n: int, seed: int, priority_share: float,
                  flex_share: float, vocab: int = 49152) -> list[Arrival]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        u = rng.random()
        if u < priority_share:  # a short chat
            tier, plen, olen = "priority", rng.randint(64, 192), rng.randint(16, 48)
        else:  # longer work: summaries, extraction
            tier = "flex" if u < priority_share + flex_share else "default"
            plen, olen = rng.randint(256, 640), rng.randint(64, 160)
        body = [rng.randrange(1000, vocab) for _ in range(plen - len(SYSTEM_PROMPT))]
        out.append(Arrival(t, tier, SYSTEM_PROMPT + body, olen))
    return out


# -------------------------------------------------------------------- worker
def worker(spec: dict) -> dict:
    """Runs in a child process: one engine, every rate; returns raw request records."""
    import torch

    if spec.get("cores"):
        os.sched_setaffinity(0, spec["cores"])
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    from tierserve.engine.llm_engine import LLMEngine
    from tierserve.llm import engine_config

    engine = LLMEngine(engine_config(**spec["engine"]))
    if spec.get("calibrate"):
        return calibrate_and_idle(engine, spec)
    results = []
    for rate in spec["rates"]:
        arrivals = [a for a in make_workload(rate, spec["requests"], spec["seed"] + int(rate * 100),
                                             spec["priority_share"], spec["flex_share"])
                    if a.tier in spec["tiers"]]
        results.append({"rate": rate, **run_open_loop(engine, arrivals)})
        engine.block_manager.reset_prefix_cache()
    return {"results": results, "threads": torch.get_num_threads()}


def run_open_loop(engine, arrivals: list[Arrival], whole_steps: list | None = None) -> dict:
    """Replay `arrivals` through `engine`; `whole_steps`, if given, gets each step's
    ([(num_tokens, context_len)...], seconds of the whole `engine.step()`)."""
    from tierserve.core.stats import StatsCollector
    from tierserve.engine.calibrate import timed_step
    from tierserve.model.generation import request_sampling
    from tierserve.sampling_params import SamplingParams

    sampling = request_sampling(engine.generation_defaults)  # as a request that sets none
    collector = StatsCollector()
    engine.add_sink(collector)
    sched = engine.scheduler
    wasted0 = dict(sched.recomputed_tokens_by_tier)
    preempt0 = sched.num_preemptions
    origin = engine.clock.now()
    i = 0
    while i < len(arrivals) or engine.has_unfinished_requests():
        now = engine.clock.now() - origin
        while i < len(arrivals) and arrivals[i].t <= now:
            a = arrivals[i]
            engine.add_request(None, a.prompt, SamplingParams(max_tokens=a.max_tokens,
                                                              ignore_eos=True, **sampling),
                               arrival_time=origin + a.t, tier=a.tier)
            i += 1
        if engine.has_unfinished_requests():
            if whole_steps is None:
                engine.step()
            else:
                timed_step(engine, collector, whole_steps, whole_step=True)
        elif i < len(arrivals):
            time.sleep(max(0.0, arrivals[i].t - now))
    wall = engine.clock.now() - origin
    engine.remove_sink(collector)
    max_seqs = engine.config.scheduler.max_num_seqs
    return {
        "wall_s": wall,
        "span_s": arrivals[-1].t if arrivals else 0.0,
        "requests": [{"tier": r.tier.label, "ttft_s": r.ttft_s, "tpot_s": r.tpot_s,
                      "finish_reason": r.finish_reason, "output_tokens": r.num_output_tokens}
                     for r in collector.requests],
        "wasted": {t.label: sched.recomputed_tokens_by_tier[t] - wasted0.get(t, 0)
                   for t in sched.recomputed_tokens_by_tier},
        "preemptions": sched.num_preemptions - preempt0,
        "full_slot_steps": sum(1 for s in collector.steps if s.num_seqs >= max_seqs),
        "steps": len(collector.steps),
    }


def step_drift(model, steps: list[tuple[list[tuple[int, int]], float]]) -> float:
    """The mean over measured `steps` ([(num_tokens, context_len)...], seconds) of each
    one's time over what `model` predicts for it: how far the machine (or the workload's
    shapes) moved from the model. NaN where no step has a positive prediction.

    The mean (StepTimeModel.mean_ratio), what a whole-step model is centred on, so
    a run on a machine that held still reads 1.0, and a twin scaled by it is centred on
    the run's steps. Until the forty-sixth session it was the median, which against a
    centred model reads under 1.0 where steps are right-skewed: 0.93-0.94 on two one-core
    replicas' steps under load (2-core Zen 3), and the twin scaled by it then ran fast.
    A stall moves a mean: over the hundreds of steps a run has, one step 1 s long where
    steps take 50 ms moves it by a few percent."""
    return model.mean_ratio(steps)


def calibrate_and_idle(engine, spec: dict) -> dict:
    """The step-time model, and TTFT of lone priority and default prompts."""
    from tierserve.core.stats import StatsCollector
    from tierserve.engine.calibrate import calibrate
    from tierserve.sampling_params import SamplingParams

    model = calibrate(engine, repeats=2)
    model.save(spec["profile"])
    arrivals = make_workload(1.0, 40, spec["seed"], spec["priority_share"], spec["flex_share"])
    idle = {}
    for tier in ("priority", "default"):
        collector = StatsCollector()
        engine.add_sink(collector)
        for a in [a for a in arrivals if a.tier == tier][:8]:  # one at a time: idle
            engine.add_request(None, a.prompt, SamplingParams(max_tokens=4, ignore_eos=True),
                               tier=tier)
            while engine.has_unfinished_requests():
                engine.step()
        engine.remove_sink(collector)
        idle[tier] = sorted(r.ttft_s for r in collector.requests)
    return {"model": asdict(model), "lone_decode_s": model.predict_s([(1, 256)]),
            "idle_ttft_s": idle}


def spawn(spec: dict) -> subprocess.Popen:
    f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(spec, f)
    f.close()
    return subprocess.Popen([sys.executable, "-m", "tierserve.bench.tiers", "--worker", f.name],
                            stdout=subprocess.PIPE, text=True)


def collect(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark worker failed (exit {proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])


# ------------------------------------------------------------------- figures
def pct(values: list[float], q: float) -> float:
    """percentile(), with NaN for no values (printed, never compared)."""
    from tierserve.core.stats import percentile

    value = percentile(values, q)
    return float("nan") if value is None else value


def summarize(run: dict, slo: dict) -> dict:
    reqs = run["requests"]
    span = max(run["span_s"], 1e-9)
    out = {"rate": run["rate"], "tok_s": sum(r["output_tokens"] for r in reqs) / run["wall_s"],
           "wasted": sum(run["wasted"].values()), "preemptions": run["preemptions"],
           "full_slot_steps": run["full_slot_steps"], "steps": run["steps"], "tiers": {}}
    good = 0
    for tier in TIER_NAMES:
        rs = [r for r in reqs if r["tier"] == tier]
        if not rs:
            continue
        ttft_slo, tpot_slo = slo[tier]
        ok = [r for r in rs if r["finish_reason"] in ("stop", "length")
              and r["ttft_s"] <= ttft_slo and (r["tpot_s"] is None or r["tpot_s"] <= tpot_slo)]
        good += len(ok)
        out["tiers"][tier] = {
            "n": len(rs), "attain": len(ok) / len(rs),
            "refused": sum(r["finish_reason"] == "refused" for r in rs),
            "ttft_p50": pct([r["ttft_s"] for r in rs], 0.5),
            "ttft_p99": pct([r["ttft_s"] for r in rs], 0.99),
            "tpot_p50": pct([r["tpot_s"] for r in rs], 0.5),
            "tpot_p99": pct([r["tpot_s"] for r in rs], 0.99),
            "wasted": run["wasted"].get(tier, 0)}
    out["goodput"] = good / span
    return out


def merge_silos(a: dict, b: dict) -> dict:
    """Two silos' runs at one rate as one deployment: requests together, the longer wall."""
    return {"rate": a["rate"], "wall_s": max(a["wall_s"], b["wall_s"]),
            "span_s": max(a["span_s"], b["span_s"]), "requests": a["requests"] + b["requests"],
            "wasted": {t: a["wasted"].get(t, 0) + b["wasted"].get(t, 0)
                       for t in set(a["wasted"]) | set(b["wasted"])},
            "preemptions": a["preemptions"] + b["preemptions"],
            "full_slot_steps": b["full_slot_steps"], "steps": a["steps"] + b["steps"]}


def line(policy: str, s: dict, args) -> str:
    parts = [f"tiers policy={policy} rate={s['rate']:g} requests={args.requests} "
             f"max_num_seqs={args.max_num_seqs} tok_s={s['tok_s']:.1f} "
             f"goodput={s['goodput']:.2f} wasted={s['wasted']} preempt={s['preemptions']} "
             f"full_slot_steps={s['full_slot_steps']}/{s['steps']}"]
    for tier, t in s["tiers"].items():
        parts.append(f"{tier}: attain={t['attain']:.2f} ttft_p50/p99={t['ttft_p50'] * 1e3:.0f}/"
                     f"{t['ttft_p99'] * 1e3:.0f}ms tpot_p50/p99={t['tpot_p50'] * 1e3:.0f}/"
                     f"{t['tpot_p99'] * 1e3:.0f}ms" + (f" refused={t['refused']}"
                                                       if t["refused"] else ""))
    return " | ".join(parts)


def capacity(summaries: list[dict], target: float = 0.9) -> float:
    """Highest rate at which every tier meets `target` attainment (0 if none)."""
    best = 0.0
    for s in summaries:
        if all(t["attain"] >= target for t in s["tiers"].values()):
            best = max(best, s["rate"])
    return best


# ---------------------------------------------------------------------- main
def run(args) -> None:
    rates = [float(r) for r in args.rates.split(",")]
    policies = args.policies.split(",")
    profile = os.path.join(tempfile.mkdtemp(), "step_time.json")
    base = {"requests": args.requests, "seed": args.bench_seed, "rates": rates,
            "priority_share": args.priority_share, "flex_share": args.flex_share,
            "tiers": list(TIER_NAMES)}
    engine_base = {"dtype": args.dtype, "max_num_seqs": args.max_num_seqs}
    cal = collect(spawn({**base, "calibrate": True, "profile": profile,
                         "engine": {**engine_base, "policy": "fcfs"}}))
    lone = cal["lone_decode_s"]
    idle = {t: statistics.median(v) for t, v in cal["idle_ttft_s"].items()}
    idle["flex"] = idle["default"]
    slo = {t: (SLO_MULTIPLES[t][0] * idle[t], SLO_MULTIPLES[t][1] * lone) for t in TIER_NAMES}
    cap = args.cap_fraction * slo["priority"][1]
    print(f"tiers calibration: lone decode step {lone * 1e3:.1f} ms, idle TTFT priority "
          f"{idle['priority'] * 1e3:.0f} ms (p99 of 8: {max(cal['idle_ttft_s']['priority']) * 1e3:.0f}"
          f" ms), default {idle['default'] * 1e3:.0f} ms; SLOs (TTFT/TPOT, from this "
          f"calibration): " + ", ".join(f"{t} {a * 1e3:.0f}/{b * 1e3:.0f} ms"
                                        for t, (a, b) in slo.items())
          + f"; tiered step cap {cap * 1e3:.0f} ms; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cpus", flush=True)
    tiered = {"policy": "tiered", "step_time_profile": profile, "priority_step_time_s": cap,
              "flex_max_wait_s": slo["flex"][0], "default_aging_s": slo["default"][0]}
    summaries: dict[str, list[dict]] = {}
    for policy in policies:
        if policy == "dedicated":
            fast = spawn({**base, "tiers": ["priority"], "cores": [0], "threads": 1,
                          "engine": {**engine_base, "policy": "fcfs",
                                     "max_num_seqs": args.dedicated_max_num_seqs}})
            rest = spawn({**base, "tiers": ["default", "flex"], "cores": [1], "threads": 1,
                          "engine": {**engine_base, **tiered, "priority_step_time_s": 0}})
            a, b = collect(fast)["results"], collect(rest)["results"]
            runs = [merge_silos(x, y) for x, y in zip(a, b)]
        else:
            engine = {**engine_base, **tiered} if policy == "tiered" else \
                {**engine_base, "policy": policy}
            runs = collect(spawn({**base, "engine": engine}))["results"]
        summaries[policy] = [summarize(r, slo) for r in runs]
        for s in summaries[policy]:
            print(line(policy, s, args), flush=True)
    report(summaries, idle, cal, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"slo": slo, "idle_ttft_s": cal["idle_ttft_s"], "lone_decode_s": lone,
                       "summaries": summaries}, f, indent=1)


def report(summaries: dict, idle: dict, cal: dict, args) -> None:
    caps = {p: capacity(s) for p, s in summaries.items()}
    print("tiers capacity (highest rate with every tier >= 90% SLO attainment): "
          + ", ".join(f"{p} {c:g} req/s" for p, c in caps.items()), flush=True)
    if "tiered" in caps and "dedicated" in caps and caps["dedicated"] > 0:
        print(f"tiers capacity ratio tiered/dedicated = {caps['tiered'] / caps['dedicated']:.2f}"
              " (target >= 1.3)")
    tiered = summaries.get("tiered", [])
    ok = [s for s in tiered if s["tiers"].get("priority", {}).get("attain", 0) >= 0.9]
    if ok:
        s = max(ok, key=lambda x: x["rate"])
        idle_p99 = max(cal["idle_ttft_s"]["priority"])
        fcfs = {x["rate"]: x for x in summaries.get("fcfs", [])}.get(s["rate"])
        thr = f", tok/s {s['tok_s'] / fcfs['tok_s']:.2f}x FCFS's (target >= 0.85)" if fcfs else ""
        print(f"tiers at {s['rate']:g} req/s (highest rate where priority meets its SLOs under "
              f"tiered): priority TTFT p99 {s['tiers']['priority']['ttft_p99'] * 1e3:.0f} ms = "
              f"{s['tiers']['priority']['ttft_p99'] / idle_p99:.2f}x idle p99 (target <= 2)"
              + thr)
    strict = {x["rate"]: x for x in summaries.get("priority", [])}
    for s in tiered:
        o = strict.get(s["rate"])
        if o and o["full_slot_steps"]:
            a, b = s["tiers"]["priority"]["attain"], o["tiers"]["priority"]["attain"]
            print(f"tiers slots binding at {s['rate']:g} req/s ({o['full_slot_steps']} full-slot "
                  f"steps under strict priority): priority attainment tiered {a:.2f} vs "
                  f"strict {b:.2f}")


def main() -> None:
    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args()
    if args.worker:
        with open(args.worker) as f:
            spec = json.load(f)
        print(json.dumps(worker(spec)))
        return
    run(args)


if __name__ == "__main__":
    main()
