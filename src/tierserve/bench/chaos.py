"""Chaos: SIGKILL `tierserve serve` at awkward moments, restart it, check what must survive.

About 410 lines, kept whole: the kill moments, the restart and the checks read the same
server process, data dir and traffic record, and apart they would pass all three around.

`--rounds` rounds on one data dir and ledger (in a temporary folder). Each round starts the
server, sends mixed traffic (streams, whole requests, a batch job) and kills it with
SIGKILL at a seeded moment of a seeded kind:

- mid-stream: streams under way (their first text came), after up to 1 s more;
- mid-batch: the batch has lines done and lines in flight, after up to 0.3 s more;
- mid-commit: a burst of short whole requests, half of them answered, after up to one
  ledger commit interval (0.25 s);
- mid-migration: start-up against a fresh copy of an old-schema ledger (its first three
  migrations, `--old-rows` rows so that the next ones take a while) and batch store,
  within 0.5 s of the server opening the ledger (its -wal file appearing: the imports
  before that take seconds, so 0.5 s after the spawn would kill before any migration).

Then it restarts the server on the same files, lets every batch finish, stops it cleanly
and checks:

1. integrity: `PRAGMA integrity_check` of the ledger and the batch store, both open and
   migrate to the latest schema, and after a mid-migration kill the old rows are there;
2. batch lines exactly once: each line index of a finished batch is in its output or error
   file once (and completed + failed = total); each line has at most one ledger row (rows
   tagged with its batch_id and custom_id), and the request id of each output line has a
   ledger row with the token counts of the line's `usage` (the run whose answer is kept);
3. no request charged twice: no request_id twice in the ledger's `requests`;
4. accepted means billed or reported failed: a whole request answered 200, or a stream
   that reached [DONE], has a ledger row with its id and its `usage` token counts (a cut
   stream or connection counts as reported failed; a miss says how long before the kill
   its answer came).
Code that does not hold an invariant yet shows up as broken. Prints per round what broke,
then one line: config, rounds, rounds with an invariant broken.

What it shares with the soak (the server, the client) is in bench/loopback.py.
"""

import argparse
import asyncio
import json
import os
import random
import shutil
import sqlite3
import tempfile
import time
from collections import Counter

from tierserve.bench.loopback import (CONFIG, FINAL, KEYS, MODEL, TIERS, batch_status,
                                      free_port, launch, ledger_rows, log_tail, make_body, send,
                                      server_cmd, stop, submit_batch, wait_ready)

KINDS = ("mid-stream", "mid-batch", "mid-commit", "mid-migration")
COMMIT_INTERVAL_S = 0.25
OLD_LEDGER_MIGRATIONS = 3


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--streams", type=int, default=3, help="streams under way at once")
    p.add_argument("--burst", type=int, default=8, help="whole requests in a mid-commit burst")
    p.add_argument("--batch-lines", type=int, default=8)
    p.add_argument("--old-rows", type=int, default=400_000,
                   help="rows in the old-schema ledger of a mid-migration round")
    p.add_argument("--bench-seed", type=int, default=4321)
    p.add_argument("--server-args", default="",
                   help="more `tierserve serve` flags, one string")


# ------------------------------------------------------------------ traffic
async def traffic_until_kill(args, url: str, proc, rng: random.Random, kind: str,
                             tag: str) -> tuple[list, float, str]:
    """Mixed traffic until the moment of `kind` comes; then SIGKILL. (What the client
    saw, the time of the kill, a note on the moment.)"""
    import httpx

    outcomes: list = []
    done = asyncio.Event()
    first_text = asyncio.Event()

    async def loop(r: random.Random, stream: bool) -> None:
        while not done.is_set():
            body = make_body(r, r.choice(TIERS), stream, 48 if stream else r.randint(2, 8))
            outcomes.append(await send(http, url, r.choice(KEYS), body,
                                       "stream" if stream else "whole",
                                       first_text=first_text if stream else None))

    async with httpx.AsyncClient(timeout=120) as http:
        bodies = [make_body(rng, None, False, rng.randint(16, 32), chat=False)
                  for _ in range(args.batch_lines)]
        batch_id = await submit_batch(http, url, bodies, tag)
        tasks = [asyncio.create_task(loop(random.Random(rng.random()), i < args.streams))
                 for i in range(args.streams + 1)]
        burst: list[asyncio.Task] = []
        try:
            note = await asyncio.wait_for(moment(http, url, rng, kind, batch_id, first_text,
                                                 burst, args.burst), 180)
        except TimeoutError:
            note = "the moment did not come in 180 s; killed anyway"
        proc.kill()
        killed_at = time.monotonic()
        proc.wait()
        done.set()
        await asyncio.wait(tasks + burst, timeout=60)
    outcomes += [t.result() for t in burst if t.done() and not t.exception()]
    return outcomes, killed_at, note


async def moment(http, url: str, rng: random.Random, kind: str, batch_id: str, first_text,
                 burst: list, size: int) -> str:
    """Wait for the moment to kill at; a note on it. A mid-commit burst's tasks are put in
    `burst`."""
    if kind == "mid-stream":
        await first_text.wait()
        delay = rng.uniform(0, 1.0)
        await asyncio.sleep(delay)
        return f"{delay:.2f} s after a first streamed token"
    if kind == "mid-batch":
        while True:
            b = await batch_status(http, url, batch_id)
            counts = b["request_counts"]
            ended = counts["completed"] + counts["failed"]
            if b["status"] in FINAL or 0 < ended < counts["total"]:
                break
            await asyncio.sleep(0.05)
        delay = rng.uniform(0, 0.3)
        await asyncio.sleep(delay)
        return f"{delay:.2f} s after {ended}/{counts['total']} lines ended ({b['status']})"
    burst += [asyncio.create_task(send(http, url, rng.choice(KEYS),
                                       make_body(rng, rng.choice(TIERS), False,
                                                 rng.randint(1, 3)), "whole"))
              for _ in range(size)]
    answered = 0
    for next_done in asyncio.as_completed(burst):
        await next_done
        answered += 1
        if answered >= size // 2:
            break
    delay = rng.uniform(0, COMMIT_INTERVAL_S)
    await asyncio.sleep(delay)
    return f"{delay:.2f} s after {answered}/{size} of a burst were answered"


# ------------------------------------------------------------------- checks
def integrity(ledger: str, batches_db: str, old_rows: int | None = None) -> list[str]:
    """Invariant 1 (see the module's doc); what broke."""
    from tierserve.batch import store
    from tierserve.metering import ledger as ledger_db

    broken = []
    for name, path, migrations in (("ledger", ledger, ledger_db.MIGRATIONS),
                                   ("batch store", batches_db, store.MIGRATIONS)):
        con = sqlite3.connect(path)
        try:
            result = [r[0] for r in con.execute("PRAGMA integrity_check")]
        finally:
            con.close()
        if result != ["ok"]:
            broken.append(f"integrity: {name}: {'; '.join(result[:3])}")
        try:
            db = ledger_db.connect(path, migrations)
            applied = {r[0] for r in db.execute("SELECT name FROM _migrations")}
            if name == "ledger" and old_rows is not None:
                kept = db.execute("SELECT count(*) FROM requests WHERE request_id LIKE "
                                  "'old-%'").fetchone()[0]
                if kept != old_rows:
                    broken.append(f"integrity: the ledger kept {kept} of its {old_rows} "
                                  "old rows")
            db.close()
        except Exception as exc:
            broken.append(f"integrity: the {name} does not open and migrate: {exc}")
            continue
        missing = [fn.__name__ for fn in migrations if fn.__name__ not in applied]
        if missing:
            broken.append(f"integrity: {name} migrations not applied: {', '.join(missing)}")
    return broken


def check_batches(data_dir: str, rows: list[tuple], checked: set) -> list[str]:
    """Invariant 2 for every batch not checked yet (all should be final by now)."""
    con = sqlite3.connect(os.path.join(data_dir, "batches.db"))
    try:
        batches = con.execute("SELECT id, status, total, completed, failed, output_file_id, "
                              "error_file_id FROM batches").fetchall()
    finally:
        con.close()
    tokens = {r[0]: (r[1], r[2]) for r in rows}
    charged = Counter()
    for r in rows:
        tags = json.loads(r[5] or "{}")
        if "batch_id" in tags:
            charged[tags["batch_id"], tags.get("custom_id")] += 1
    broken = []
    for bid, status, total, completed, failed, out_id, err_id in batches:
        if bid in checked:
            continue
        if status not in FINAL:
            broken.append(f"batch once: batch {bid} still {status} after the restart")
            continue
        checked.add(bid)
        seen, unbilled, other = Counter(), 0, 0
        for fid, ok in ((out_id, True), (err_id, False)):
            if fid is None:
                continue
            with open(os.path.join(data_dir, "files", fid)) as f:
                for line in f:
                    obj = json.loads(line)
                    seen[int(obj["custom_id"].rsplit("-", 1)[1])] += 1
                    response = obj.get("response") or {}
                    usage = (response.get("body") or {}).get("usage") or {}
                    row = tokens.get(response.get("request_id"))
                    unbilled += ok and row is None
                    other += ok and row is not None and row != (
                        usage.get("prompt_tokens"), usage.get("completion_tokens"))
        twice = sorted(i for i, n in seen.items() if n > 1)
        missing = sorted(set(range(total)) - set(seen))
        if twice or missing or completed + failed != total:
            broken.append(f"batch once: {bid} ({status}): lines twice {twice}, missing "
                          f"{missing}, completed {completed} + failed {failed} of {total}")
        more = sorted(c for (b, c), n in charged.items() if b == bid and n > 1)
        if more:
            broken.append(f"batch charged once: {bid}: {len(more)} lines have several rows "
                          f"({', '.join(more[:3])})")
        if unbilled:
            broken.append(f"batch charged once: {bid}: {unbilled} output lines with no "
                          "ledger row")
        if other:
            broken.append(f"batch charged once: {bid}: {other} output lines whose ledger row "
                          "has other token counts (a row of another run of the line)")
    return broken


def check_ledger(rows: list[tuple], outcomes: list, killed_at: float,
                 reported: set) -> list[str]:
    """Invariants 3 and 4."""
    broken = []
    ids = Counter(r[0] for r in rows)
    dups = sorted(i for i, n in ids.items() if n > 1 and i not in reported)
    reported.update(dups)
    if dups:
        broken.append(f"charged twice: {len(dups)} request ids with several rows "
                      f"({', '.join(dups[:3])})")
    missing = [o for o in outcomes if o.status == "ok" and o.id not in ids]
    if missing:
        gaps = sorted(1000 * (killed_at - o.end) for o in missing)
        broken.append(f"accepted: {len(missing)} answered requests with no ledger row ("
                      f"{', '.join(f'{o.kind} {o.id}' for o in missing[:2])}; answered "
                      f"{', '.join(f'{g:.0f}' for g in gaps[:5])} ms before the kill)")
    tokens = {r[0]: (r[1], r[2]) for r in rows}
    other = [o.id for o in outcomes if o.status == "ok" and o.id in tokens
             and tokens[o.id] != (o.prompt_tokens, o.completion_tokens)]
    if other:
        broken.append(f"accepted: {len(other)} answered requests whose ledger row has other "
                      f"token counts than their usage ({', '.join(other[:2])})")
    return broken


# ------------------------------------------------------------------- rounds
def old_schema(folder: str, rows: int) -> None:
    """A ledger at the schema of tierserve before issue 16 (its first three migrations:
    then m004 builds a unique index over `rows` rows, which takes a while to kill in),
    and a batch store at every migration but its last: what an older tierserve left."""
    from tierserve import db as database
    from tierserve.batch import store
    from tierserve.metering import ledger as ledger_db

    db = database.connect(os.path.join(folder, "ledger.db"), ledger_db.MIGRATIONS[:OLD_LEDGER_MIGRATIONS])
    cols = ("time, request_id, tenant, model, tier_requested, tier_served, prompt_tokens, "
            "cached_tokens, output_tokens, prefill_cost, decode_cost, charge, finish_reason")
    now = time.time()
    with db:
        db.executemany(f"INSERT INTO requests ({cols}) VALUES ({', '.join('?' * 13)})",
                       ((now - i, f"old-{i}", "team-a", MODEL, "default", "default", 20, 0, 8,
                         1e-6, 2e-6, 5e-6, "stop") for i in range(rows)))
    db.close()
    database.connect(os.path.join(folder, "data", "batches.db"), store.MIGRATIONS[:-1]).close()


def migration_round(args, tmp: str, r: int, rng: random.Random) -> tuple[list, str]:
    template = os.path.join(tmp, "old-schema")
    if not os.path.exists(template):
        old_schema(template, args.old_rows)
    folder = os.path.join(tmp, f"migration-{r}")
    shutil.copytree(template, folder)
    ledger, data = os.path.join(folder, "ledger.db"), os.path.join(folder, "data")
    log = os.path.join(tmp, "server.log")
    port = free_port()
    cmd = server_cmd(args, port, ledger, data, os.path.join(tmp, "config.yaml"))
    proc = launch(cmd, log)
    deadline = time.monotonic() + 300
    while not os.path.exists(ledger + "-wal") and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.005)
    delay = rng.uniform(0, 0.5)
    time.sleep(delay)
    proc.kill()
    proc.wait()
    from tierserve.metering import ledger as ledger_db
    con = sqlite3.connect(ledger)
    applied = con.execute("SELECT count(*) FROM _migrations").fetchone()[0]
    con.close()
    note = (f"killed {delay:.2f} s after the ledger was opened, {applied}/"
            f"{len(ledger_db.MIGRATIONS)} ledger migrations applied")
    proc = launch(cmd, log)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}")
    finally:
        clean = stop(proc)
    broken = integrity(ledger, os.path.join(data, "batches.db"), args.old_rows)
    broken += check_ledger(ledger_rows(ledger), [], 0.0, set())
    if not clean:
        broken.append("restart: the restarted server did not stop cleanly")
    shutil.rmtree(folder, ignore_errors=True)
    return broken, note


def traffic_round(args, tmp: str, r: int, rng: random.Random, kind: str, checked: set,
                  reported: set) -> tuple[list, str]:
    ledger, data = os.path.join(tmp, "ledger.db"), os.path.join(tmp, "data")
    log = os.path.join(tmp, "server.log")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = server_cmd(args, port, ledger, data, os.path.join(tmp, "config.yaml"))
    proc = launch(cmd, log)
    try:
        wait_ready(proc, url)
        outcomes, killed_at, note = asyncio.run(
            traffic_until_kill(args, url, proc, rng, kind, f"r{r}"))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    proc = launch(cmd, log)
    try:
        wait_ready(proc, url)
        waited = wait_batches(os.path.join(data, "batches.db"), 600)
    finally:
        clean = stop(proc)
    rows = ledger_rows(ledger)
    broken = integrity(ledger, os.path.join(data, "batches.db"))
    broken += check_batches(data, rows, checked)
    broken += check_ledger(rows, outcomes, killed_at, reported)
    if not clean:
        broken.append("restart: the restarted server did not stop cleanly")
    seen = Counter(o.status for o in outcomes)
    return broken, (f"{note}; client saw {dict(seen)}; batches done {waited:.0f} s "
                    "after the restart")


def wait_batches(path: str, timeout_s: float) -> float:
    """Wait until no batch is active (read from the store); seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        con = sqlite3.connect(path, timeout=30)
        try:
            active = con.execute("SELECT count(*) FROM batches WHERE status NOT IN "
                                 f"({', '.join('?' * len(FINAL))})", FINAL).fetchone()[0]
        finally:
            con.close()
        if not active:
            break
        time.sleep(0.5)
    return time.monotonic() - start


def run(args) -> None:
    start = time.perf_counter()
    rng = random.Random(args.bench_seed)
    config = (f"rounds={args.rounds} streams={args.streams} burst={args.burst} "
              f"batch_lines={args.batch_lines} old_rows={args.old_rows} "
              f"model={args.model or 'default'} device={args.device} "
              f"max_num_seqs={args.max_num_seqs} dtype={args.dtype} seed={args.bench_seed}"
              + (f" server_args='{args.server_args}'" if args.server_args else ""))
    kinds, broken_rounds, what = Counter(), 0, Counter()
    checked, reported = set(), set()
    with tempfile.TemporaryDirectory(prefix="tierserve-chaos-") as tmp:
        with open(os.path.join(tmp, "config.yaml"), "w") as f:
            f.write(CONFIG)
        for r in range(args.rounds):
            kind = rng.choice(KINDS)
            kinds[kind] += 1
            t = time.perf_counter()
            try:
                if kind == "mid-migration":
                    broken, note = migration_round(args, tmp, r, rng)
                else:
                    broken, note = traffic_round(args, tmp, r, rng, kind, checked, reported)
            except Exception as exc:
                broken, note = [f"round: failed: {exc!r}"], \
                    "server log tail: " + " / ".join(log_tail(os.path.join(tmp, "server.log"),
                                                              5).splitlines())
            broken_rounds += bool(broken)
            what.update({b.split(":")[0] for b in broken})
            print(f"chaos round {r} {kind}: "
                  f"{'BROKEN: ' + ' | '.join(broken) if broken else 'ok'} ({note}; "
                  f"{time.perf_counter() - t:.0f} s)", flush=True)
    by_kind = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
    by_what = ", ".join(f"{k} {n}" for k, n in sorted(what.items())) or "none"
    print(f"chaos {config} | rounds {args.rounds} ({by_kind}) | rounds with an invariant "
          f"broken {broken_rounds} (rounds per invariant: {by_what}) | wall "
          f"{time.perf_counter() - start:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    from tierserve.engine_args import add_engine_args

    p = argparse.ArgumentParser(prog="chaos", description=__doc__.split("\n")[0])
    add_args(p)
    add_engine_args(p)
    run(p.parse_args(argv))
    return 0
