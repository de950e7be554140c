"""Soak: a long run of mixed traffic against `tierserve serve`, looking for leaks and drift.

Starts `tierserve serve` on a free loopback port (a temporary data dir and ledger, a YAML
config with two tenants), then for `--minutes` keeps `--concurrency` clients busy with a
seeded mix of tiers (priority, default, flex), whole and streamed answers, and streams the
client drops after a few chunks; every `--batch-every-s` it submits a small batch job (at
most two unfinished at once). Every `--sample-s` it reads the server's resident memory
(/proc/PID/status) and /metrics. When the time is up it lets the batches finish, waits
until the server is idle, and prints one line with:

- RSS growth from the first window after warm-up to the last (the run is cut into
  `--windows` windows; the first one is warm-up), mean of the samples in each;
- KV blocks still held when idle (`tierserve_kv_blocks_in_use`; anything but 0 leaked);
- p99 latency of those two windows (whole answers end to end, streams to first token);
- the ledger against what the client got, matched by id (a response's id is its ledger
  request_id): answered ids with and without a row, ids with several rows, rows of
  dropped or failed requests, other rows; `usage` token sums against the rows' sums.

The server process and the client are in bench/loopback.py (shared with bench/chaos.py).
"""

import argparse
import asyncio
import math
import os
import random
import sys
import tempfile
import time
from collections import Counter

from tierserve.bench.loopback import (CONFIG, FINAL, KEYS, TIERS, Outcome, batch_outcomes,
                                      batch_status, free_port, launch, ledger_rows, log_tail,
                                      make_body, rss_mb, scrape, send, server_cmd, stop,
                                      submit_batch, wait_ready)
from tierserve.bench.serve import pct


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=30.0, help="how long traffic runs")
    p.add_argument("--concurrency", type=int, default=4, help="clients sending at once")
    p.add_argument("--windows", type=int, default=10,
                   help="windows the run is cut into (the first is warm-up)")
    p.add_argument("--sample-s", type=float, default=2.0, help="RSS and /metrics period")
    p.add_argument("--batch-every-s", type=float, default=30.0)
    p.add_argument("--batch-lines", type=int, default=4)
    p.add_argument("--max-output", type=int, default=32, help="largest max_tokens")
    p.add_argument("--bench-seed", type=int, default=4321)
    p.add_argument("--server-args", default="",
                   help="more `tierserve serve` flags, one string")


def match_ledger(outcomes: list[Outcome], rows: list[tuple]) -> dict:
    """The ledger against the answers: counts and token sums (see the module's doc)."""
    by_id: dict[str, list[tuple]] = {}
    for row in rows:
        by_id.setdefault(row[0], []).append(row)
    answered = {o.id: o for o in outcomes if o.status == "ok" and o.id}
    dropped = {o.id for o in outcomes if o.status != "ok" and o.id}
    matched = [by_id[i][0] for i in answered if i in by_id]
    return {
        "rows": len(rows), "answered": len(answered), "matched": len(matched),
        "missing": sorted(i for i in answered if i not in by_id),
        "duplicate_ids": sorted(i for i, rs in by_id.items() if len(rs) > 1),
        "failed_rows": sum(len(by_id.get(i, ())) for i in dropped),
        "other_rows": sum(len(rs) for i, rs in by_id.items()
                          if i not in answered and i not in dropped),
        "usage_tokens": (sum(o.prompt_tokens for i, o in answered.items() if i in by_id),
                         sum(o.completion_tokens for i, o in answered.items() if i in by_id)),
        "ledger_tokens": (sum(r[1] for r in matched), sum(r[2] for r in matched)),
    }


# ------------------------------------------------------------------- the soak
async def client(http, url: str, rng: random.Random, deadline: float, outcomes: list,
                 max_output: int) -> None:
    while time.monotonic() < deadline:
        kind = rng.choices(("whole", "stream", "abort"), (0.4, 0.4, 0.2))[0]
        key, tier = rng.choice(KEYS), rng.choice(TIERS)
        if kind == "abort":
            body = make_body(rng, tier, True, 64)
            outcomes.append(await send(http, url, key, body, kind, rng.randint(1, 6)))
        else:
            body = make_body(rng, tier, kind == "stream", rng.randint(4, max_output))
            outcomes.append(await send(http, url, key, body, kind))


async def batcher(http, url: str, rng: random.Random, deadline: float, args,
                  batch_ids: list) -> None:
    while time.monotonic() + args.batch_every_s / 2 < deadline:
        unfinished = [b for b in batch_ids[-2:]
                      if (await batch_status(http, url, b))["status"] not in FINAL]
        if len(unfinished) < 2:
            bodies = [make_body(rng, None, False, rng.randint(4, args.max_output), chat=False)
                      for _ in range(args.batch_lines)]
            batch_ids.append(await submit_batch(http, url, bodies, f"soak{len(batch_ids)}"))
        await asyncio.sleep(args.batch_every_s)


async def sampler(http, url: str, pid: int, period_s: float, samples: list) -> None:
    import httpx

    while True:
        try:
            m = await scrape(http, url)
        except httpx.HTTPError:
            m = {}
        samples.append((time.monotonic(), rss_mb(pid), m.get("tierserve_kv_blocks_in_use"),
                        m.get("tierserve_kv_cache_usage_ratio")))
        await asyncio.sleep(period_s)


async def settle(http, url: str, batch_ids: list, timeout_s: float = 600.0) -> tuple:
    """Wait for the batches to end and the server to be idle: (batch line outcomes,
    unfinished batch ids, /metrics when idle)."""
    deadline = time.monotonic() + timeout_s
    outcomes, pending = [], list(batch_ids)
    while pending and time.monotonic() < deadline:
        batch = await batch_status(http, url, pending[0])
        if batch["status"] in FINAL:
            outcomes += await batch_outcomes(http, url, batch)
            pending.pop(0)
        else:
            await asyncio.sleep(0.5)
    while time.monotonic() < deadline:
        m = await scrape(http, url)
        if m.get("tierserve_requests_running", 0) + m.get("tierserve_requests_waiting", 0) == 0:
            break
        await asyncio.sleep(0.5)
    await asyncio.sleep(1.0)  # several ledger commit intervals
    return outcomes, pending, await scrape(http, url)


async def soak(args, url: str, pid: int) -> tuple:
    import httpx

    t0 = time.monotonic()
    deadline = t0 + 60 * args.minutes
    outcomes, samples, batch_ids = [], [], []
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        sampling = asyncio.create_task(sampler(http, url, pid, args.sample_s, samples))
        await asyncio.gather(
            batcher(http, url, random.Random(args.bench_seed), deadline, args, batch_ids),
            *(client(http, url, random.Random(args.bench_seed + 1 + i), deadline, outcomes,
                     args.max_output) for i in range(args.concurrency)))
        lines, unfinished, idle = await settle(http, url, batch_ids)
        sampling.cancel()
    return t0, outcomes + lines, samples, batch_ids, unfinished, idle


def window_figures(t0: float, span_s: float, n: int, outcomes: list, samples: list) -> dict:
    """RSS and p99 latency of the first window after warm-up and of the last one."""
    def window(t: float) -> int:
        return min(max(int((t - t0) * n / span_s), 0), n - 1)

    ends = ((1 if n > 2 else 0), n - 1)
    rss = [[s[1] for s in samples if window(s[0]) == w and s[1]] for w in ends]
    e2e = [[o.end - o.start for o in outcomes if o.kind == "whole" and o.status == "ok"
            and window(o.end) == w] for w in ends]
    ttft = [[o.ttft for o in outcomes if o.ttft is not None and window(o.end) == w]
            for w in ends]
    by_window = [[s[1] for s in samples if window(s[0]) == w and s[1]] for w in range(n)]
    return {"rss": tuple(sum(x) / len(x) if x else float("nan") for x in rss),
            "rss_by_window": [round(sum(x) / len(x)) if x else None for x in by_window],
            "e2e_p99": tuple(pct(x, 99) for x in e2e),
            "ttft_p99": tuple(pct(x, 99) for x in ttft),
            "n": tuple(len(a) + len(b) for a, b in zip(e2e, ttft))}


def _change(a: float, b: float) -> str:
    return f"{100 * (b - a) / a:+.1f}%" if a and not math.isnan(a + b) else "n/a"


def run(args) -> None:
    start = time.perf_counter()
    config = (f"minutes={args.minutes:g} concurrency={args.concurrency} "
              f"windows={args.windows} batch_every_s={args.batch_every_s:g} "
              f"batch_lines={args.batch_lines} max_output={args.max_output} "
              f"model={args.model or 'default'} device={args.device} "
              f"max_num_seqs={args.max_num_seqs} dtype={args.dtype} seed={args.bench_seed}"
              + (f" server_args='{args.server_args}'" if args.server_args else ""))
    with tempfile.TemporaryDirectory(prefix="tierserve-soak-") as tmp:
        ledger, log = os.path.join(tmp, "ledger.db"), os.path.join(tmp, "server.log")
        with open(os.path.join(tmp, "config.yaml"), "w") as f:
            f.write(CONFIG)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = launch(server_cmd(args, port, ledger, os.path.join(tmp, "data"),
                                 os.path.join(tmp, "config.yaml")), log)
        try:
            wait_ready(proc, url)
            t0, outcomes, samples, batch_ids, unfinished, idle = asyncio.run(
                soak(args, url, proc.pid))
            at_idle = match_ledger(outcomes, ledger_rows(ledger))
        except BaseException:
            print(f"soak: failed; the server's last lines:\n{log_tail(log)}", file=sys.stderr)
            raise
        finally:
            clean = stop(proc)
        after = match_ledger(outcomes, ledger_rows(ledger))
    w = window_figures(t0, 60 * args.minutes, args.windows, outcomes, samples)
    kinds = Counter(o.kind for o in outcomes)
    statuses = Counter(o.status for o in outcomes)
    leaked = idle.get("tierserve_kv_blocks_in_use")
    peak = max((s[2] for s in samples if s[2] is not None), default=None)
    print(f"soak detail: outcomes {dict(statuses)}; batches {len(batch_ids)} (unfinished "
          f"{len(unfinished)}); samples {len(samples)}; window requests first/last "
          f"{w['n'][0]}/{w['n'][1]}; clean stop {clean}, then {after['rows']} ledger rows, "
          f"{len(after['missing'])} answered ids missing; missing when idle (first 3) "
          f"{at_idle['missing'][:3]}, duplicate ids {at_idle['duplicate_ids'][:3]}; rss MB "
          f"by window {w['rss_by_window']}", flush=True)
    m, (up, uo), (lp, lo) = at_idle, at_idle["usage_tokens"], at_idle["ledger_tokens"]
    kv = (f"kv blocks in use when idle {leaked:.0f} (peak {peak:.0f})" if leaked is not None
          else f"kv blocks in use: no gauge (kv usage ratio when idle "
               f"{idle.get('tierserve_kv_cache_usage_ratio', float('nan')):.3f}, stale)")
    print(f"soak {config} | requests {len(outcomes)} (whole {kinds['whole']}, streams "
          f"{kinds['stream']}, dropped streams {kinds['abort']}, batch lines {kinds['batch']}, "
          f"not ok {len(outcomes) - statuses['ok'] - statuses['aborted']}) | rss "
          f"{w['rss'][0]:.0f} -> {w['rss'][1]:.0f} MB ({_change(*w['rss'])}) | {kv} | p99 "
          f"e2e {w['e2e_p99'][0]:.2f} -> {w['e2e_p99'][1]:.2f} s ({_change(*w['e2e_p99'])}), "
          f"p99 ttft {w['ttft_p99'][0]:.2f} -> {w['ttft_p99'][1]:.2f} s "
          f"({_change(*w['ttft_p99'])}) | ledger {m['rows']} rows: answered {m['answered']}, "
          f"with a row {m['matched']}, missing {len(m['missing'])}, duplicate ids "
          f"{len(m['duplicate_ids'])}, rows of dropped or failed requests {m['failed_rows']}, "
          f"other rows {m['other_rows']} | tokens usage/ledger prompt {up}/{lp} output {uo}/{lo} | "
          f"wall {time.perf_counter() - start:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    from tierserve.engine_args import add_engine_args

    p = argparse.ArgumentParser(prog="soak", description=__doc__.split("\n")[0])
    add_args(p)
    add_engine_args(p)
    run(p.parse_args(argv))
    return 0
