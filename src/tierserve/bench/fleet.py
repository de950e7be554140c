"""Fleet mode's figures: tierserve's gateway in front of real replicas on this machine,
each scenario measured side by side with the replicas alone in one run.

About 460 lines, kept whole: the scenarios share one process harness and load client, and
each is a short function; splitting would scatter one benchmark's config over files.

    overhead    gateway + one vLLM replica vs the replica alone, concurrency 16
    fastlane    priority probes during a default flood at concurrency 64: idle vs flooded
                TTFT/ITL p99, through the gateway vs vLLM alone (its own priority field)
    throttle    only lower-tier traffic at concurrency 64: throughput vs the replica alone
    affinity    two tierserve replicas, prompts sharing long per-tenant prefixes: prefix
                affinity vs round-robin (and load-only) routing, and a no-sharing control
    replicas    two tierserve replicas (one core each) behind the gateway vs one two-core
                tierserve, a mixed-tier load
    ceiling     requests/s one gateway routes to a minimal upstream (a stub that answers
                one token at once: it measures the gateway alone, labelled as such)
    metering    the gateway's per-request cost estimate vs the replicas' exact meters
Every scenario prints one line per configuration. Load goes to loopback only. On two
cores the client, the gateway and the replica share the CPU: read ratios, not absolutes.
"""

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tierserve.bench.serve import one_request, pct
from tierserve.bench.throughput import make_prompts

MODEL = "SmolLM2-135M-Instruct"
VOCAB = 49152
REPO = Path(__file__).resolve().parents[3]
SCENARIOS = ("overhead", "fastlane", "throttle", "affinity", "replicas", "ceiling", "metering")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenarios", nargs="*", default=list(SCENARIOS),
                   help=f"which to run (default all): {', '.join(SCENARIOS)}")
    p.add_argument("--requests", type=int, default=64, help="requests per run (default 64)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--tenants", type=int, default=8,
                   help="affinity: tenants whose 512-token prefixes the prompts share (default 8)")
    p.add_argument("--verbose", action="store_true", help="per-request detail where a scenario has it")


# ------------------------------------------------------------------ processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A server in its own process group, stopped with its children."""

    def __init__(self, cmd: list[str], env: dict | None = None, health: str = "/health"):
        self.port = free_port()
        cmd = [c.replace("{port}", str(self.port)) for c in cmd]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="fleet-bench-", suffix=".log",
                                               delete=False)
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, cwd=REPO,
                                     stdout=self.log, stderr=self.log, start_new_session=True)
        deadline = time.time() + 400
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{cmd[:4]} exited; log: {self.log.name}")
            try:
                if httpx.get(self.url + health, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{cmd[:4]} not ready in 400 s; log: {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


VLLM_SEQS = 128
"""The vLLM replica's --max-num-seqs, told to the gateway: above the load's 64 clients, so
the slots the gateway keeps for priority do not bind unless its limit is cut."""


def vllm() -> Proc:
    return Proc(["bash", "scripts/vllm_replica.sh", "serve", "{port}", "--max-num-seqs",
                 str(VLLM_SEQS)])


def tierserve(*args: str, threads: int = 2) -> Proc:
    profile = REPO / "src/tierserve/hardware/profiles/cpu/smollm2-135m.json"
    return Proc([sys.executable, "-m", "tierserve.cli", "serve", "--port", "{port}",
                 "--no-ledger", "--no-batches", "--step-time-profile", str(profile),
                 "--disable-uvicorn-access-log",  # as measured before the log existed
                 "--machine-price-per-hour", "1.0", *args],
                env={"OMP_NUM_THREADS": str(threads)})


def gateway(backends: list[dict], fleet: dict | None = None, slo: dict | None = None) -> Proc:
    import yaml

    cfg = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
    yaml.safe_dump({"backends": backends, "fleet": fleet or {}, "slo": slo or {}}, cfg)
    cfg.close()
    return Proc([sys.executable, "-m", "tierserve.cli", "serve", "--port", "{port}",
                 "--config", cfg.name, "--ledger", cfg.name + ".db", "--no-batches",
                 "--disable-uvicorn-access-log",  # a line per request costs gateway CPU
                 "--machine-price-per-hour", "1.0"])


# ----------------------------------------------------------------------- load
async def closed_loop(url, prompts, max_tokens, concurrency, extra=None) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        sem = asyncio.Semaphore(concurrency)
        errors = 0

        async def one(p):
            nonlocal errors
            async with sem:
                try:
                    return await one_request(client, url, MODEL, p, max_tokens,
                                             extra=extra)
                except (RuntimeError, httpx.HTTPError):
                    errors += 1
                    return 0, float("nan"), []
        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - start
    return {"tok_s": sum(r[0] for r in results) / wall, "ttft": [r[1] for r in results],
            "itl": [x for r in results for x in r[2]], "errors": errors, "wall": wall}


def fmt(run: dict) -> str:
    return (f"{run['tok_s']:.1f} tok/s, ttft p50 {1e3 * pct(run['ttft'], 50):.0f} ms "
            f"p99 {1e3 * pct(run['ttft'], 99):.0f} ms, itl p50 {1e3 * pct(run['itl'], 50):.1f} "
            f"ms p99 {1e3 * pct(run['itl'], 99):.1f} ms, errors {run['errors']}")


def prompts(n, length, seed):
    return make_prompts(n, length, VOCAB, seed)


# ------------------------------------------------------------------ scenarios
def overhead(args, replica: Proc) -> None:
    gw = gateway([{"url": replica.url, "kind": "vllm", "models": [MODEL],
                   "max_num_seqs": VLLM_SEQS}])
    try:
        asyncio.run(closed_loop(gw.url, prompts(4, 128, 1), 8, 4))  # warm both paths
        runs = {"alone": [], "gateway": []}
        for rnd in range(2):
            for name, url in (("alone", replica.url), ("gateway", gw.url)):
                run = asyncio.run(closed_loop(url, prompts(args.requests, 128,
                                                           args.seed + 10 * rnd), 128, 16))
                runs[name].append(run)
                print(f"fleet overhead round={rnd} {name} concurrency=16 "
                      f"requests={args.requests} 128/128 | {fmt(run)}", flush=True)
        tok = {k: sum(r["tok_s"] for r in v) / len(v) for k, v in runs.items()}
        ttft = {k: pct([t for r in v for t in r["ttft"]], 50) for k, v in runs.items()}
        print(f"fleet overhead concurrency=16 | gateway/alone throughput "
              f"{tok['gateway'] / tok['alone']:.3f}, ttft p50 added "
              f"{1e3 * (ttft['gateway'] - ttft['alone']):.1f} ms", flush=True)
    finally:
        gw.stop()


async def flood_with_probes(url, n_flood, flood_extra, probe_extra, seed, probes=12):
    """A default flood at concurrency 64 and, once it runs, priority probes one by one."""
    flood = asyncio.create_task(closed_loop(url, prompts(n_flood, 128, seed), 128, 64,
                                            flood_extra))
    await asyncio.sleep(8.0)
    probe_runs = []
    for i in range(probes):
        probe_runs.append(await closed_loop(url, prompts(1, 128, seed + 1000 + i), 32, 1,
                                            probe_extra))
        await asyncio.sleep(0.5)
    flood_run = await flood
    merged = {"ttft": [t for r in probe_runs for t in r["ttft"]],
              "itl": [x for r in probe_runs for x in r["itl"]]}
    return flood_run, merged


def fastlane(args, replica: Proc) -> None:
    idle = asyncio.run(closed_loop(replica.url, prompts(8, 128, 5), 32, 1))
    print(f"fleet fastlane idle priority probes (vLLM alone) | {fmt(idle)}", flush=True)
    n = 2 * args.requests
    lone = 1e3 * pct(idle["itl"], 50)
    gw = gateway([{"url": replica.url, "kind": "vllm", "models": [MODEL],
                   "max_num_seqs": VLLM_SEQS}],
                 {"reserved_priority_seqs": 4},
                 {"priority": {"ttft_s": 2 * pct(idle["ttft"], 99),
                               "tpot_s": 1.25 * pct(idle["itl"], 99)}})
    try:
        for name, url, flood_x, probe_x in (
                ("vllm-alone", replica.url, {"priority": 1}, {"priority": 0}),
                ("gateway", gw.url, {"service_tier": "default"}, {"service_tier": "priority"})):
            flood, probes = asyncio.run(flood_with_probes(url, n, flood_x, probe_x, args.seed))
            print(f"fleet fastlane {name} flood=64x{n} 128/128 probes=12 128/32 | flood "
                  f"{flood['tok_s']:.1f} tok/s errors {flood['errors']} | priority ttft p99 "
                  f"{1e3 * pct(probes['ttft'], 99):.0f} ms "
                  f"({pct(probes['ttft'], 99) / pct(idle['ttft'], 99):.2f}x idle), itl p99 "
                  f"{1e3 * pct(probes['itl'], 99):.1f} ms "
                  f"({pct(probes['itl'], 99) / pct(idle['itl'], 99):.2f}x idle; idle itl p50 "
                  f"{lone:.1f} ms)", flush=True)
    finally:
        gw.stop()


def throttle(args, replica: Proc) -> None:
    gw = gateway([{"url": replica.url, "kind": "vllm", "models": [MODEL],
                   "max_num_seqs": VLLM_SEQS}],
                 {"reserved_priority_seqs": 4})
    try:
        out = {}
        for name, url, extra in (("alone", replica.url, {}),
                                 ("gateway", gw.url, {"service_tier": "default"})):
            out[name] = run = asyncio.run(closed_loop(url, prompts(2 * args.requests, 128,
                                                                   args.seed + 3), 128, 64,
                                                      extra))
            print(f"fleet throttle {name} default-only concurrency=64 "
                  f"requests={2 * args.requests} | {fmt(run)}", flush=True)
        print(f"fleet throttle | gateway/alone throughput "
              f"{out['gateway']['tok_s'] / out['alone']['tok_s']:.3f}", flush=True)
    finally:
        gw.stop()


def shared_prompts(n, tenants, prefix, tail, seed, shared=True):
    import random
    rng = random.Random(seed)
    heads = [[rng.randrange(100, VOCAB) for _ in range(prefix)] for _ in range(tenants)]
    out = []
    for i in range(n):
        head = heads[rng.randrange(tenants)] if shared else \
            [rng.randrange(100, VOCAB) for _ in range(prefix)]
        out.append(head + [rng.randrange(100, VOCAB) for _ in range(tail)])
    return out


ROUTINGS = ("affinity", "round-robin", "load")


def affinity(args) -> None:
    reps = [tierserve("--max-num-seqs", "16", threads=1) for _ in range(2)]
    try:
        backends = [{"url": r.url, "kind": "tierserve", "models": [MODEL], "max_num_seqs": 16,
                     "name": f"t{i}"} for i, r in enumerate(reps)]
        for shared in (True, False):
            what = f"{args.tenants}-tenant shared 512-token prefixes" if shared else \
                "nothing shared"
            runs = {name: [] for name in ROUTINGS}
            for rnd, order in enumerate((ROUTINGS, ROUTINGS[::-1])):  # drift cancels
                for routing in order:
                    gw = gateway(backends, {"routing": routing})
                    try:  # fresh prompts each run: nothing cached by the run before
                        seed = args.seed + 100 * shared + 10 * rnd + ROUTINGS.index(routing)
                        work = shared_prompts(args.requests, args.tenants, 512, 32, seed,
                                              shared)
                        run = asyncio.run(closed_loop(gw.url, work, 16, 8))
                        runs[routing].append(run)
                        print(f"fleet affinity prompts={what} round={rnd} "
                              f"routing={routing} replicas=2x1core concurrency=8 "
                              f"requests={args.requests} 544/16 | {run['tok_s']:.1f} tok/s, "
                              f"ttft p50 {1e3 * pct(run['ttft'], 50):.0f} ms p90 "
                              f"{1e3 * pct(run['ttft'], 90):.0f} ms, errors {run['errors']}",
                              flush=True)
                    finally:
                        gw.stop()
            tok = {k: sum(r["tok_s"] for r in v) / len(v) for k, v in runs.items()}
            p90 = {k: pct([t for r in v for t in r["ttft"]], 90) for k, v in runs.items()}
            print(f"fleet affinity prompts={what} | both rounds, vs round-robin: " + "; ".join(
                f"{k} throughput {tok[k] / tok['round-robin']:.3f}, ttft p90 "
                f"{p90[k] / p90['round-robin']:.3f}" for k in ROUTINGS if k != "round-robin"),
                flush=True)
    finally:
        for r in reps:
            r.stop()


async def mixed(url, n, seed, share=0.2):
    import random
    rng = random.Random(seed)
    tiers = ["priority" if rng.random() < share else "default" for _ in range(n)]
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        sem = asyncio.Semaphore(16)
        ps = prompts(n, 128, seed)

        async def one(i):
            async with sem:
                return tiers[i], await one_request(client, url, MODEL, ps[i], 64, tiers[i])
        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - start
    tok = sum(r[1][0] for r in results) / wall
    prio = [r[1][1] for r in results if r[0] == "priority"]
    return tok, prio


def replicas(args) -> None:
    two = [tierserve("--max-num-seqs", "32", threads=1) for _ in range(2)]
    try:
        gw = gateway([{"url": r.url, "kind": "tierserve", "models": [MODEL], "max_num_seqs": 32,
                       "name": f"t{i}"} for i, r in enumerate(two)])
        try:
            tok, prio = asyncio.run(mixed(gw.url, args.requests, args.seed + 30))
            print(f"fleet replicas 2x1-core tierserve behind the gateway concurrency=16 "
                  f"priority=20% requests={args.requests} 128/64 | {tok:.1f} tok/s, priority "
                  f"ttft p99 {1e3 * pct(prio, 99):.0f} ms", flush=True)
        finally:
            gw.stop()
    finally:
        for r in two:
            r.stop()
    one = tierserve("--max-num-seqs", "64", threads=2)
    try:
        tok, prio = asyncio.run(mixed(one.url, args.requests, args.seed + 30))
        print(f"fleet replicas 1x2-core tierserve alone concurrency=16 priority=20% "
              f"requests={args.requests} 128/64 | {tok:.1f} tok/s, priority ttft p99 "
              f"{1e3 * pct(prio, 99):.0f} ms", flush=True)
    finally:
        one.stop()


def ceiling(args) -> None:
    """Each client in turn against the stub alone and the gateway: httpx (as an OpenAI SDK
    client would be) and aiohttp's lighter one, which leaves more of the two cores
    to the gateway. The gateway's CPU per request (/proc) holds whatever the client."""
    stub = Proc([sys.executable, "-m", "tierserve.bench.stub_upstream", "{port}"])
    gw = gateway([{"url": stub.url, "kind": "openai", "models": [MODEL], "max_num_seqs": 4096}],
                 {"reserved_priority_seqs": 0})
    try:
        for client in ("httpx", "aiohttp"):
            for name, proc in (("stub alone", stub), ("gateway", gw)):
                cpu = _cpu_s(gw.proc.pid)
                n = asyncio.run(_hammer(proc.url, 10.0, 64, client))
                extra = f", gateway cpu {1e3 * (_cpu_s(gw.proc.pid) - cpu) / max(n, 1):.2f} " \
                    "ms/request" if proc is gw else ""
                print(f"fleet ceiling {name} (minimal upstream, benchmark only) client={client} "
                      f"concurrency=64 10 s | {n / 10.0:.0f} req/s{extra}", flush=True)
    finally:
        gw.stop()
        stub.stop()


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _hammer(url, seconds, concurrency, client="httpx") -> int:
    from tierserve.router import remote

    done = 0
    deadline = time.perf_counter() + seconds
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    session = remote.session(30.0, 30.0)
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=None)) as c:
        async def worker():
            nonlocal done
            while time.perf_counter() < deadline:
                if client == "httpx":
                    ok = (await c.post(url + "/v1/completions", json=body)).status_code == 200
                else:
                    async with session.post(url + "/v1/completions", json=body) as r:
                        await r.read()
                        ok = r.status == 200
                done += ok  # not `done += await ...`: it reads done first
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    await session.close()
    return done


def metering(args) -> None:
    """In-process gateway (its estimates are read directly) over two tierserve replicas
    whose own meters report each request's exact cost (same price on both sides)."""
    import statistics
    import threading

    import uvicorn

    from tierserve.core.step_time import StepTimeModel
    from tierserve.model.metadata import default_model_path
    from tierserve.model.tokenizer import Tokenizer
    from tierserve.router.fleet import FleetBackend
    from tierserve.router.remote import ReplicaSpec
    from tierserve.server.app import create_app
    from tierserve.server.serve import DEFAULT_CPU_PROFILE
    from tierserve.server.settings import ServerSettings

    reps = [tierserve("--max-num-seqs", "16", threads=1) for _ in range(2)]
    try:
        specs = [ReplicaSpec(r.url, [MODEL], "tierserve", price_per_hour=1.0,
                             max_num_seqs=16, name=f"t{i}") for i, r in enumerate(reps)]
        backend = FleetBackend(specs, MODEL, StepTimeModel.load(DEFAULT_CPU_PROFILE),
                               tokenizer=Tokenizer.load(str(default_model_path())))
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(create_app(backend, ServerSettings(port=port),
                                                          MODEL),
                                               host="127.0.0.1", port=port, log_level="error"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        import random
        rng = random.Random(args.seed)
        work = [make_prompts(1, rng.choice([32, 128, 512]), VOCAB, args.seed + i)[0]
                for i in range(args.requests)]
        asyncio.run(closed_loop(f"http://127.0.0.1:{port}", work, 48, 8))
        server.should_exit = True
        thread.join(timeout=30)
        checks = [(e.machine_cost, x.machine_cost) for e, x in backend.cost_checks]
        errors = sorted(abs(est - exact) / exact for est, exact in checks)
        total_est = sum(e for e, _ in checks)
        total_exact = sum(x for _, x in checks)

        def part(name):  # signed: which way each half of the split errs
            return statistics.median((getattr(e, name) - getattr(x, name)) / x.machine_cost
                                     for e, x in backend.cost_checks)
        print(f"fleet metering 2x1-core tierserve concurrency=8 requests={len(errors)} "
              f"prompts 32/128/512 output 48 | per-request |estimate-exact|/exact median "
              f"{100 * statistics.median(errors):.1f}% p90 {100 * pct(errors, 90):.1f}%, "
              f"sum estimate/exact {total_est / total_exact:.3f}; median signed error of "
              f"the prefill part {100 * part('prefill_cost'):+.1f}%, decode part "
              f"{100 * part('decode_cost'):+.1f}% (of exact)", flush=True)
        if args.verbose:
            for e, x in backend.cost_checks:
                print(f"  estimate {e.prefill_cost:.3e} + {e.decode_cost:.3e}  exact "
                      f"{x.prefill_cost:.3e} + {x.decode_cost:.3e}")
    finally:
        for r in reps:
            r.stop()


def run(args) -> None:
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        raise SystemExit(f"error: unknown scenario {sorted(unknown)[0]!r}")
    needs_vllm = [s for s in args.scenarios if s in ("overhead", "fastlane", "throttle")]
    replica = vllm() if needs_vllm else None
    try:
        for s in args.scenarios:
            fn = globals()[s]
            fn(args, replica) if s in needs_vllm else fn(args)
    finally:
        if replica is not None:
            replica.stop()
