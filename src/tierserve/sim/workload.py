"""Workloads for the simulator: what arrives when, in which tier, how long.

A workload is a list of `SimRequest`s (open loop) or a `ClosedLoop` of N users. Specs on
the command line:

    poisson:rate=2,n=500[,priority=0.2,flex=0.3,prompt=128-512,output=32-256,seed=0]
    gamma:rate=2,n=500,cv=3[,...]          bursty arrivals (cv > 1: burstier than Poisson)
    trace:PATH[,speed=1,n=1000,priority=0.2,...]   arrived_at,num_prefill_tokens,num_decode_tokens
    closed:users=16,n=500[,think=0,...]    each user sends its next request when the last ends
    diurnal:rate=2,peak=3,period=86400,n=500[,phase=0,...]   a daily rate curve (below)
    ledger:PATH[,speed=1,n=1000]           replay a tierserve ledger's requests

NOTE: diurnal arrivals
    The rate swings as a cosine between `rate` (the trough, at t = phase) and `peak` (half
    a period later): rate(t) = rate + (peak - rate) * (1 - cos(2 pi (t - phase) / period)) / 2.
    Arrivals are a non-homogeneous Poisson process drawn by thinning: candidates at the
    highest rate, each kept with probability rate(t) / highest rate (seeded).
"""

import csv
import math
import random
import sqlite3
from dataclasses import dataclass, replace
from pathlib import Path

from tierserve.errors import ConfigError


@dataclass
class SimRequest:
    arrival_s: float
    tier: str
    prompt_tokens: int
    output_tokens: int
    shared_prefix: int = 0
    """Leading prompt tokens shared by every request (a system prompt)."""
    prompt_ids: tuple[int, ...] | None = None
    """The prompt itself (a recorded request replayed: its prefixes are shared with the
    requests it really shares them with); None: made up from the lengths above."""
    tenant: str = ""
    """Whose request: tenants share a tier by `weight` (core/fair.py), as in the engine."""
    weight: float = 1.0


@dataclass
class ClosedLoop:
    users: int
    requests: list[SimRequest]
    """Served in order; arrival_s is ignored (a user's next starts when its last ends)."""
    think_s: float = 0.0


def parse_spec(spec: str) -> tuple[str, str | None, dict]:
    kind, _, rest = spec.partition(":")
    path, opts = None, {}
    for i, part in enumerate(p for p in rest.split(",") if p):
        if "=" not in part:
            if kind in ("trace", "ledger") and i == 0:
                path = part
                continue
            raise ConfigError(f"workload spec: expected key=value, got {part!r} in {spec!r}")
        key, value = part.split("=", 1)
        opts[key] = value
    return kind, path, opts


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def _tiers(rng: random.Random, n: int, opts: dict) -> list[str]:
    p, f, b = (float(opts.get(k, d)) for k, d in (("priority", 0.2), ("flex", 0.0),
                                                   ("batch", 0.0)))
    out = []
    for _ in range(n):
        u = rng.random()
        out.append("priority" if u < p else "flex" if u < p + f else
                   "batch" if u < p + f + b else "default")
    return out


def make_workload(spec: str) -> list[SimRequest] | ClosedLoop:
    kind, path, o = parse_spec(spec)
    rng = random.Random(int(o.get("seed", 0)))
    n = int(o.get("n", 200))
    prompt, output = _range(o.get("prompt", "128-512")), _range(o.get("output", "32-256"))
    prefix = int(o.get("shared_prefix", 0))

    def lengths():
        return rng.randint(*prompt), rng.randint(*output)

    if kind in ("poisson", "gamma"):
        rate = float(o.get("rate", 1.0))
        cv = float(o.get("cv", 1.0)) if kind == "gamma" else 1.0
        shape = 1.0 / (cv * cv)
        t, reqs = 0.0, []
        for tier in _tiers(rng, n, o):
            t += rng.gammavariate(shape, 1.0 / (rate * shape))
            reqs.append(SimRequest(t, tier, *lengths(), shared_prefix=prefix))
        return reqs
    if kind == "trace":
        if path is None:
            raise ConfigError("trace workload needs a path: trace:FILE.csv")
        return read_trace(path, float(o.get("speed", 1.0)), int(o["n"]) if "n" in o else None,
                          rng, o)
    if kind == "closed":
        reqs = [SimRequest(0.0, tier, *lengths(), shared_prefix=prefix)
                for tier in _tiers(rng, n, o)]
        return ClosedLoop(int(o.get("users", 16)), reqs, float(o.get("think", 0.0)))
    if kind == "diurnal":
        times = diurnal_arrivals(rng, n, float(o.get("rate", 1.0)), float(o.get("peak", 2.0)),
                                 float(o.get("period", 86400.0)), float(o.get("phase", 0.0)))
        return [SimRequest(t, tier, *lengths(), shared_prefix=prefix)
                for t, tier in zip(times, _tiers(rng, n, o))]
    if kind == "ledger":
        if path is None:
            raise ConfigError("ledger workload needs a path: ledger:LEDGER.db")
        return read_ledger(path, float(o.get("speed", 1.0)),
                           int(o["n"]) if "n" in o else None)
    raise ConfigError(f"unknown workload kind {kind!r}: poisson, gamma, diurnal, trace, "
                      "ledger or closed")


def diurnal_arrivals(rng: random.Random, n: int, rate: float, peak: float, period: float,
                     phase: float = 0.0) -> list[float]:
    """`n` arrival times of the cosine rate curve (see the module's note), by thinning."""
    top = max(rate, peak)
    if min(rate, peak) < 0 or top <= 0 or period <= 0:
        raise ConfigError(f"diurnal workload: need rate, peak >= 0 (not both 0) and period "
                          f"> 0, got rate={rate}, peak={peak}, period={period}")
    t, out = 0.0, []
    while len(out) < n:
        t += rng.expovariate(top)
        now = rate + (peak - rate) * (1 - math.cos(2 * math.pi * (t - phase) / period)) / 2
        if rng.random() * top < now:
            out.append(t)
    return out


def read_trace(path: str, speed: float, limit: int | None, rng: random.Random,
               opts: dict) -> list[SimRequest]:
    """A trace CSV (arrived_at, num_prefill_tokens, num_decode_tokens), as in
    the repository's data/traces; `speed` > 1 replays it faster. Tiers drawn as in `opts`."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as exc:
        raise ConfigError(f"cannot read the trace {path}: {exc}") from None
    rows = rows[:limit] if limit else rows
    try:
        reqs = [SimRequest(float(r["arrived_at"]) / speed, "default",
                           max(1, int(r["num_prefill_tokens"])),
                           max(1, int(r["num_decode_tokens"]))) for r in rows]
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"{path}: expected columns arrived_at, num_prefill_tokens, "
                          f"num_decode_tokens ({exc})") from None
    for req, tier in zip(reqs, _tiers(rng, len(reqs), opts)):
        req.tier = tier
    return reqs


def read_ledger(path: str, speed: float, limit: int | None) -> list[SimRequest]:
    """A tierserve ledger's requests in arrival order (finish time less end-to-end time),
    from the first arrival on; `speed` > 1 replays faster. Each comes back in the tier
    that served it, with the prompt and output lengths it had (refused and aborted ones
    too: they arrived, and took what they took)."""
    if not Path(path).is_file():
        raise ConfigError(f"cannot read the ledger {path}: no such file")
    try:
        db = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True)
        try:
            rows = db.execute("SELECT time - COALESCE(e2e_s, 0), tier_served, prompt_tokens, "
                              "output_tokens FROM requests ORDER BY 1, id").fetchall()
        finally:
            db.close()
    except sqlite3.Error as exc:
        raise ConfigError(f"cannot read the ledger {path}: {exc}") from None
    rows = rows[:limit] if limit else rows
    first = rows[0][0] if rows else 0.0
    return [SimRequest((arrival - first) / speed, tier, max(1, prompt), max(1, output))
            for arrival, tier, prompt, output in rows]


def with_priority_fraction(workload: list[SimRequest] | ClosedLoop, fraction: float,
                           seed: int = 0) -> list[SimRequest] | ClosedLoop:
    """The same arrivals and lengths with `fraction` of them (seeded) in the priority
    tier; former priority requests not drawn become default, other tiers stay."""
    rng = random.Random(seed)
    requests = workload.requests if isinstance(workload, ClosedLoop) else workload
    out = [replace(r, tier="priority" if rng.random() < fraction else
                   "default" if r.tier == "priority" else r.tier) for r in requests]
    return replace(workload, requests=out) if isinstance(workload, ClosedLoop) else out
