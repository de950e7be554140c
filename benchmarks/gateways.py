"""Several gateways as one (issue 31), side by side in one run, on a throwaway PostgreSQL
server (tests/pg.py starts it):

  cost      what the shared state adds per request, timed in this process over
            `--calls` sequential calls: a budget hold (one transaction: advisory lock,
            spend and holds summed, insert) and its settle (the ledger row with the hold's
            delete in one transaction), beside the in-memory hold; a rate-limit bucket
            take (one transaction) beside the in-memory one. p50/p99 in ms.
  ceiling   1, 2 and 4 `tierserve serve --backend` gateways (each its own process, one
            --database), and one on SQLite with nothing shared as the baseline, in front of the same two minimal upstreams
            (tierserve.bench.stub_upstream: one token at once, labelled `stub`), with a
            budget and a rate limit on the tenant so every request holds, settles and
            takes from a bucket: 64 clients spread over the gateways for `--seconds`,
            requests per second (all processes share the machine's cores).
  race      4 gateways, 64 concurrent requests of one tenant whose budget covers about
            10: the overshoot past the budget, in units of one request's worst case.

  replicas  1, 2 and 4 gateways in front of two real tierserve replicas (SmolLM2-135M, one
            torch thread each): 32 clients, 32 output tokens, requests per second.

  order     tier order through two gateways over one 6-slot replica (limit 4 for lower
            tiers): the share of 20 ms samples with more lower-tier requests running than
            the limit, and priority TTFT, with the limit shared (one PostgreSQL) and not
            (two SQLite ledgers).

    python benchmarks/gateways.py [--part cost,ceiling,replicas,order,race] [--seconds 10]
                                  [--calls 500]
"""

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from epp import Proc, wait_http  # noqa: E402  (benchmarks/epp.py: the same processes)
from pg import create_database, postgres_server  # noqa: E402

from tierserve.bench.loopback import free_port  # noqa: E402
from tierserve.core.stats import percentile  # noqa: E402
from tierserve.tiers import Tier  # noqa: E402

KEY = "sk-bench"
CONFIG = """api_keys: {{sk-bench: {{tenant: t}}}}
budgets: {{t: {{amount_usd: {budget!r}, period: day}}}}
rate_limits: {{t: {{requests_per_minute: {rpm}}}}}
"""


def ms(values, q):
    return f"{1e3 * percentile(values, q):.2f}"


def part_cost(url: str, calls: int, echo: str) -> None:
    from tierserve.metering.ledger import Ledger
    from tierserve.metering.prices import PriceList
    from tierserve.metering.recorder import Budget, Recorder
    from tierserve.metering.shared import SharedState
    from tierserve.server.limits import RateLimit, RateLimiter

    ledger = Ledger(url)  # migrates
    shared = SharedState(url, "bench")
    local = Recorder("m", PriceList(), None, {"t": Budget(1e9, "day")})
    hold, settle, mem, take, mem_take = [], [], [], [], []
    for i in range(calls):
        t0 = time.perf_counter()
        shared.hold("t", 1e9, 0.0, [(f"r{i}", 1e-6)])
        t1 = time.perf_counter()
        with shared._lock, shared._db as db:  # what the ledger writer's commit adds
            db.execute("DELETE FROM holds WHERE request_id = ?", (f"r{i}",))
        t2 = time.perf_counter()
        local.reserve("t", [(f"r{i}", 1e-6)])
        t3 = time.perf_counter()
        hold.append(t1 - t0)
        settle.append(t2 - t1)
        mem.append(t3 - t2)
    limiter = RateLimiter({"t": RateLimit(requests_per_minute=10**9)}, shared=shared)
    plain = RateLimiter({"t": RateLimit(requests_per_minute=10**9)})
    for _ in range(calls):
        t0 = time.perf_counter()
        limiter.take("t", 1, 0)
        t1 = time.perf_counter()
        plain.take("t", 1, 0)
        take.append(t1 - t0)
        mem_take.append(time.perf_counter() - t1)
    shared.close()
    ledger.close()
    print(f"gateways part=cost {echo} calls={calls} hold_ms p50/p99={ms(hold, .5)}/"
          f"{ms(hold, .99)} settle_delete_ms p50/p99={ms(settle, .5)}/{ms(settle, .99)} "
          f"in_memory_hold_ms p50/p99={ms(mem, .5)}/{ms(mem, .99)} bucket_take_ms "
          f"p50/p99={ms(take, .5)}/{ms(take, .99)} in_memory_take_ms p50/p99="
          f"{ms(mem_take, .5)}/{ms(mem_take, .99)}", flush=True)


def gateway(tmp: Path, name: str, upstreams: list[str], database: str | None, config: Path):
    """database None: the embedded SQLite ledger, holds and buckets in memory."""
    port = free_port()
    store = ["--database", database] if database else ["--ledger", str(tmp / f"{name}.db")]
    cmd = [sys.executable, "-m", "tierserve.cli", "serve", "--port", str(port), "--config",
           str(config), *store, "--no-batches", "--served-model-name",
           "stub", "--disable-uvicorn-access-log",
           *sum((["--backend", u] for u in upstreams), [])]
    return Proc(cmd, tmp / f"{name}.log"), f"http://127.0.0.1:{port}"


async def load(urls: list[str], clients: int, seconds: float, max_tokens: int = 1,
               total: int | None = None) -> tuple[float, dict]:
    """Closed loop (or `total` requests at once): (req/s, status counts)."""
    stop = time.perf_counter() + seconds
    counts: dict = {}
    body = {"model": "stub", "prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as s:
        async def send(url):
            try:
                async with s.post(url + "/v1/completions", json=body, headers=headers) as r:
                    await r.read()
                    counts[r.status] = counts.get(r.status, 0) + 1
            except aiohttp.ClientError:
                counts["error"] = counts.get("error", 0) + 1

        async def client(i):
            while time.perf_counter() < stop:
                await send(urls[i % len(urls)])

        t0 = time.perf_counter()
        if total is not None:
            await asyncio.gather(*(send(urls[i % len(urls)]) for i in range(total)))
        else:
            await asyncio.gather(*(client(i) for i in range(clients)))
        return counts.get(200, 0) / (time.perf_counter() - t0), counts


async def part_ceiling(server: str, tmp: Path, args, echo: str) -> None:
    ports = [free_port() for _ in range(2)]
    stubs = [Proc([sys.executable, "-m", "uvicorn", "tierserve.bench.stub_upstream:app",
                   "--port", str(p), "--log-level", "error", "--no-access-log"],
                  tmp / f"stub{i}.log") for i, p in enumerate(ports)]
    upstreams = [f"http://127.0.0.1:{p}" for p in ports]
    config = tmp / "ceiling.yaml"
    config.write_text(CONFIG.format(budget=1e9, rpm=10**9))
    results = {}
    try:
        for u in upstreams:
            await wait_http(u + "/health")
        for n in (0, 1, 2, 4):  # 0: one gateway on SQLite (nothing shared), the baseline
            database = create_database(server) if n else None
            gws = [gateway(tmp, f"gw{n}-{i}", upstreams, database, config)
                   for i in range(max(n, 1))]
            try:
                for _, url in gws:
                    await wait_http(url + "/health")
                urls = [url for _, url in gws]
                await load(urls, 16, 2)  # warm
                results[n] = await load(urls, 64, args.seconds)
            finally:
                for p, _ in gws:
                    p.stop()
    finally:
        for p in stubs:
            p.stop()
    print(f"gateways part=ceiling upstream=stub(one token at once) {echo} clients=64 "
          f"seconds={args.seconds} " + " ".join(
              (f"gateways{n}_req_s={rps:.0f}" if n else f"sqlite1_req_s={rps:.0f}")
              for n, (rps, _) in results.items())
          + " statuses=" + ";".join(f"{n}:{c}" for n, (_, c) in results.items()),
          flush=True)


async def part_replicas(server: str, tmp: Path, args, echo: str) -> None:
    """1, 2 and 4 gateways (one --database) in front of two real tierserve replicas of
    SmolLM2-135M (one torch thread each): 32 clients, 32 output tokens, `--seconds`."""
    from tierserve.server.serve import DEFAULT_CPU_PROFILE
    ports = [free_port() for _ in range(2)]
    reps = [Proc([sys.executable, "-m", "tierserve.cli", "serve", "--port", str(p),
                  "--no-ledger", "--no-batches", "--served-model-name", "stub",
                  "--step-time-profile", DEFAULT_CPU_PROFILE, "--max-num-seqs", "16"],
                 tmp / f"replica{i}.log", env={"OMP_NUM_THREADS": "1"})
            for i, p in enumerate(ports)]
    upstreams = [f"http://127.0.0.1:{p}" for p in ports]
    config = tmp / "replicas.yaml"
    config.write_text(CONFIG.format(budget=1e9, rpm=10**9))
    results = {}
    try:
        for u in upstreams:
            await wait_http(u + "/health", 300)
        for n in (1, 2, 4):
            database = create_database(server)
            gws = [gateway(tmp, f"rgw{n}-{i}", upstreams, database, config) for i in range(n)]
            try:
                for _, url in gws:
                    await wait_http(url + "/health")
                urls = [url for _, url in gws]
                await load(urls, 8, 3, max_tokens=32)  # warm
                results[n] = await load(urls, 32, args.seconds, max_tokens=32)
            finally:
                for p, _ in gws:
                    p.stop()
    finally:
        for p in reps:
            p.stop()
    print(f"gateways part=replicas upstream=2x tierserve SmolLM2-135M (1 thread each) {echo} "
          f"clients=32 max_tokens=32 seconds={args.seconds} " + " ".join(
              f"gateways{n}_req_s={rps:.1f}" for n, (rps, _) in results.items())
          + " statuses=" + ";".join(f"{n}:{c}" for n, (_, c) in results.items()),
          flush=True)


async def part_order(server: str, tmp: Path, args, echo: str) -> None:
    """Tier order through two gateways: one real tierserve replica of 6 slots (the
    gateways keep 2 for priority: a lower-tier limit of 4), 16 default clients spread over
    both gateways, a priority probe every 0.5 s through each in turn. Sampled every 20 ms
    from the replica's /metrics: the share of samples with more lower-tier requests
    running than the limit (an inversion: a priority slot taken). Side by side: the two
    gateways on one PostgreSQL database (one shared limit) and on their own SQLite ledgers
    (each keeps its own)."""
    from tierserve.server.serve import DEFAULT_CPU_PROFILE
    rport = free_port()
    rep = Proc([sys.executable, "-m", "tierserve.cli", "serve", "--port", str(rport),
                "--no-ledger", "--no-batches", "--served-model-name", "stub",
                "--step-time-profile", DEFAULT_CPU_PROFILE, "--max-num-seqs", "6"],
               tmp / "order-replica.log", env={"OMP_NUM_THREADS": "1"})
    rurl = f"http://127.0.0.1:{rport}"
    config = tmp / "order.yaml"
    config.write_text(CONFIG.format(budget=1e9, rpm=10**9)
                      + "fleet: {reserved_priority_seqs: 2}\n"
                      + f"backends: [{{url: '{rurl}', kind: vllm, max_num_seqs: 6}}]\n")
    out = {}
    try:
        await wait_http(rurl + "/health", 300)
        for mode in ("shared", "separate"):
            database = create_database(server) if mode == "shared" else None
            gws = [gateway(tmp, f"order-{mode}{i}", [], database, config) for i in range(2)]
            try:
                for _, url in gws:
                    await wait_http(url + "/health")
                out[mode] = await _order_run([u for _, u in gws], rurl, args.seconds)
            finally:
                for p, _ in gws:
                    p.stop()
    finally:
        rep.stop()
    print(f"gateways part=order upstream=1x tierserve SmolLM2-135M (6 slots, 1 thread) {echo} "
          f"default_clients=16 seconds={args.seconds} " + " ".join(
              f"{m}: over_limit_share={r['over']:.3f} max_lower={r['max']} "
              f"priority_ttft_p50/p99_ms={r['p50']:.0f}/{r['p99']:.0f} "
              f"default_req_s={r['rps']:.1f}" for m, r in out.items()), flush=True)


async def _order_run(urls: list[str], replica: str, seconds: float) -> dict:
    stop = time.perf_counter() + seconds
    headers = {"Authorization": f"Bearer {KEY}"}
    samples, ttfts, done, probing = [], [], [0], [False]
    async with aiohttp.ClientSession() as s:
        async def client(i):
            body = {"model": "stub", "prompt": f"Flood {i}", "max_tokens": 48,
                    "ignore_eos": True}
            while time.perf_counter() < stop:
                async with s.post(urls[i % 2] + "/v1/completions", json=body,
                                  headers=headers) as r:
                    await r.read()
                    done[0] += r.status == 200

        async def prober():
            i = 0
            while time.perf_counter() < stop:
                await asyncio.sleep(0.5)
                body = {"model": "stub", "prompt": f"Quick {i}", "max_tokens": 4,
                        "stream": True, "service_tier": "priority"}
                t0 = time.perf_counter()
                probing[0] = True
                async with s.post(urls[i % 2] + "/v1/completions", json=body,
                                  headers=headers) as r:
                    async for line in r.content:
                        if line.startswith(b"data: {") and b'"text":""' not in line:
                            ttfts.append(time.perf_counter() - t0)
                            break
                    await r.read()
                probing[0] = False
                i += 1

        async def sampler():
            while time.perf_counter() < stop:
                async with s.get(replica + "/metrics") as r:
                    text = await r.text()
                # the replica is told no tiers (kind vllm: only an order): every request
                # runs as default there; a probe in flight is the one that is not
                running = sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
                              if x.startswith("tierserve_requests_running{"))
                samples.append(int(running) - int(probing[0]))
                await asyncio.sleep(0.02)

        t0 = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(16)), prober(), sampler())
        rps = done[0] / (time.perf_counter() - t0)
    return {"over": sum(x > 4 for x in samples) / max(len(samples), 1),
            "max": max(samples, default=0), "p50": 1e3 * percentile(ttfts, 0.5),
            "p99": 1e3 * percentile(ttfts, 0.99), "rps": rps}


async def part_race(server: str, tmp: Path, echo: str) -> None:
    import psycopg

    from tierserve.metering.prices import PriceList
    ports = [free_port() for _ in range(2)]
    stubs = [Proc([sys.executable, "-m", "uvicorn", "tierserve.bench.stub_upstream:app",
                   "--port", str(p), "--log-level", "error", "--no-access-log"],
                  tmp / f"race-stub{i}.log") for i, p in enumerate(ports)]
    upstreams = [f"http://127.0.0.1:{p}" for p in ports]
    worst = PriceList().charge(Tier.DEFAULT, len(b"hi"), 0, 1)
    budget = 10 * worst
    config = tmp / "race.yaml"
    config.write_text(CONFIG.format(budget=budget, rpm=10**9))
    database = create_database(server)
    gws = []
    try:
        for u in upstreams:
            await wait_http(u + "/health")
        gws = [gateway(tmp, f"race{i}", upstreams, database, config) for i in range(4)]
        for _, url in gws:
            await wait_http(url + "/health")
        _, counts = await load([u for _, u in gws], 64, 0, total=64)
        time.sleep(1.0)  # the ledgers' writers commit
    finally:
        for p, _ in gws:
            p.stop()
        for p in stubs:
            p.stop()
    with psycopg.connect(database) as db:
        n, total = db.execute("SELECT count(*), coalesce(sum(charge), 0) FROM requests "
                              "WHERE tenant = 't'").fetchone()
        held = db.execute("SELECT count(*) FROM holds").fetchone()[0]
    print(f"gateways part=race {echo} gateways=4 concurrent=64 budget={budget:.3g} "
          f"worst_case={worst:.3g} admitted={n} statuses={counts} charged={total:.3g} "
          f"overshoot_in_worst_cases={(total - budget) / worst:.2f} holds_left={held}",
          flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", default="cost,ceiling,replicas,order,race")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--calls", type=int, default=500)
    args = p.parse_args()
    parts = args.part.split(",")
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.machine())
    echo = f"cpu={cpu!r} cpus={os.cpu_count()}"
    tmp = Path(tempfile.mkdtemp(prefix="gateways-"))
    with postgres_server() as url:  # a database on it; create_database makes more
        server = url
        if "cost" in parts:
            part_cost(create_database(server), args.calls, echo)
        if "ceiling" in parts:
            asyncio.run(part_ceiling(server, tmp, args, echo))
        if "replicas" in parts:
            asyncio.run(part_replicas(server, tmp, args, echo))
        if "order" in parts:
            asyncio.run(part_order(server, tmp, args, echo))
        if "race" in parts:
            asyncio.run(part_race(server, tmp, echo))
    return 0


if __name__ == "__main__":
    sys.exit(main())
