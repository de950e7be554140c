"""Budget overshoot: a tenant with a tiny budget sends many requests at once.

    python benchmarks/budget.py [--concurrency 64] [--budget-usd 0.0001] [--max-tokens 64]

`tierserve serve` runs as a subprocess on loopback with a ledger and one tenant whose
budget is a few requests' worth; `concurrency` chat requests are sent at the same moment.
Afterwards the ledger says what the tenant was charged. Printed: how many were admitted,
the spend, the overshoot (spend beyond the budget) and the largest worst-case charge of
one request (its prompt and max_tokens at the default tier's price), which is the bound
the budget promises (issue 16: overshoot at most one request's worst case).
"""

import argparse
import asyncio
import os
import platform
import sqlite3
import sys
import tempfile

from tierserve.bench.loopback import free_port, launch, log_tail, stop, wait_ready
from tierserve.metering.prices import PriceList
from tierserve.tiers import Tier


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--budget-usd", type=float, default=1e-4)
    p.add_argument("--max-tokens", type=int, default=64)


async def send_all(url: str, n: int, max_tokens: int) -> list[int]:
    import httpx

    async with httpx.AsyncClient(timeout=600) as http:
        async def one(i):
            r = await http.post(url + "/v1/chat/completions", headers={
                "Authorization": "Bearer sk-tiny"}, json={
                "model": "bench", "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": f"Tell me a story, number {i}."}]})
            return r.status_code
        return await asyncio.gather(*(one(i) for i in range(n)))


def run(args) -> None:
    tmp = tempfile.mkdtemp(prefix="tierserve-budget-")
    config, ledger = os.path.join(tmp, "config.yaml"), os.path.join(tmp, "ledger.db")
    with open(config, "w") as f:
        f.write(f"api_keys: {{sk-tiny: {{tenant: tiny}}}}\n"
                f"budgets: {{tiny: {{amount_usd: {args.budget_usd!r}, period: total}}}}\n"
                f"max_num_seqs: 16\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = launch([sys.executable, "-m", "tierserve.cli", "serve", "--host", "127.0.0.1",
                   "--port", str(port), "--served-model-name", "bench", "--config", config,
                   "--ledger", ledger], os.path.join(tmp, "server.log"))
    try:
        wait_ready(proc, url)
        codes = asyncio.run(send_all(url, args.concurrency, args.max_tokens))
    except Exception:
        print(log_tail(os.path.join(tmp, "server.log")), file=sys.stderr)
        raise
    finally:
        stop(proc)
    db = sqlite3.connect(ledger)
    spent, rows, prompt_max = db.execute(
        "SELECT sum(charge), count(*), max(prompt_tokens) FROM requests "
        "WHERE tenant = 'tiny'").fetchone()
    worst = PriceList().charge(Tier.DEFAULT, prompt_max or 0, 0, args.max_tokens)
    over = max(0.0, (spent or 0.0) - args.budget_usd)
    print(f"budget: machine={platform.machine()} cpus={os.cpu_count()} concurrency="
          f"{args.concurrency} budget_usd={args.budget_usd:g} max_tokens={args.max_tokens} | "
          f"admitted {codes.count(200)}/{len(codes)} (429: {codes.count(429)}), ledger rows "
          f"{rows}, spent ${spent or 0:.3g}, overshoot ${over:.3g} = {over / worst:.2f} x one "
          f"request's worst case ${worst:.3g} (target <= 1)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_args(p)
    run(p.parse_args())
