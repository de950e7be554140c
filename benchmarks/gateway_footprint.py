"""A fleet gateway's start-up time and resident memory: `tierserve serve --backend` in front
of a minimal upstream (tierserve.bench.stub_upstream: one fixed token per answer, so
nothing but the gateway is measured), from the process start to `/health` 200, and its
RSS when ready and after `--requests` streamed completions. Also whether the process
mapped libtorch (a gateway runs no model, so it should not).

    python benchmarks/gateway_footprint.py [--rounds 3] [--requests 200] [--port 8441]

Two cases: `cold`, each start with an empty tierserve cache (the GGUF's tokenizer is built
on the way, as on a machine where nothing ran yet), and `warm`, the cache kept between
starts (every later start). One line: the median of `--rounds` starts of each, with the
config echoed.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from side_by_side import wait_ready


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return any("libtorch" in line for line in f)


def complete(port: int) -> None:
    body = json.dumps({"model": "stub", "prompt": "hi", "max_tokens": 1,
                       "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()


def one_start(args, upstream_port: int, cache: str) -> tuple[float, float, float, bool]:
    cmd = [sys.executable, "-m", "tierserve.cli", "serve", "--host", "127.0.0.1",
           "--port", str(args.port), "--backend", f"http://127.0.0.1:{upstream_port}",
           "--served-model-name", "stub", "--no-ledger", "--no-batches",
           "--disable-uvicorn-access-log"]
    env = {**os.environ, "TIERSERVE_CACHE_DIR": cache}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        ready_s = wait_ready(args.port, proc, 120, path="/health", poll_s=0.02)
        ready_mb = rss_mb(proc.pid)
        for _ in range(args.requests):
            complete(args.port)
        return ready_s, ready_mb, rss_mb(proc.pid), maps_torch(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def summary(runs: list) -> str:
    return (f"start-to-ready {statistics.median(r[0] for r in runs):.2f} s, RSS ready "
            f"{statistics.median(r[1] for r in runs):.0f} MB, after requests "
            f"{statistics.median(r[2] for r in runs):.0f} MB")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--port", type=int, default=8441)
    p.add_argument("--upstream-port", type=int, default=8442)
    args = p.parse_args(argv)
    upstream = subprocess.Popen([sys.executable, "-m", "tierserve.bench.stub_upstream",
                                 str(args.upstream_port)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        wait_ready(args.upstream_port, upstream, 60, path="/health", poll_s=0.05)
        cold = []
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory() as tmp:
                cold.append(one_start(args, args.upstream_port, tmp))
        with tempfile.TemporaryDirectory() as tmp:
            one_start(args, args.upstream_port, tmp)  # fills the cache
            warm = [one_start(args, args.upstream_port, tmp) for _ in range(args.rounds)]
    finally:
        upstream.terminate()
        upstream.wait(timeout=30)
    torch_loaded = any(r[3] for r in cold + warm)
    print(f"gateway_footprint rounds={args.rounds} requests={args.requests} "
          f"cpu={platform.processor() or platform.machine()}: cold: {summary(cold)}; warm: "
          f"{summary(warm)}; libtorch mapped: {'yes' if torch_loaded else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
