"""`tierserve plan --forecast`: an hour-by-hour schedule (schedule.py), each hour
searched with the simulator at that hour's forecast traffic.

NOTE: the search for one hour
    An hour's traffic is its interactive rate (priority, default and flex requests / 3600),
    their shares, and the mean prompt and output tokens of a request. The rate is rounded
    *up* to a geometric grid (`grid`, 10% steps), the shares to 5% and the means to the
    grid, and the hour is simulated as a `window_s` window of Poisson arrivals with that
    mix (lengths uniform within +-50% of the means; seeded): hours that round alike share
    one search. For each candidate cell (max_num_seqs x max_num_batched_tokens) the fewest
    replicas meeting every SLO at `attainment` are found as `tierserve plan` finds them
    (Planner.simulate), counting up from a floor that lighter hours set in that cell (what
    they needed, one more than what failed them). A later cell is only tried one replica
    below the best so far, so a tie goes to the first cell unsimulated: the larger
    max_num_seqs. Its reserved priority slots follow Little's law on the deciding run
    (priority requests/s per replica x their median end-to-end time, rounded up to a
    power of two; none without priority traffic), and all hours on the same fleet take the
    most any of them wants: one setting per fleet size. The step cap is the priority TPOT
    target (or 3x a lone decode step), the same every hour.

    Needs are taken to be monotone in the rate (more traffic never needs fewer replicas;
    hours of different mixes make this approximate). So the rounded hours, sorted by
    rate, are bracketed: both ends of a run are searched, and where they agree every hour
    between takes their answer unsimulated; otherwise the run is halved. A day of a dozen
    distinct hours then costs a handful of searches.

NOTE: headroom
    Actual hours stray from the forecast by about its backtest error, and an hour planned
    to the letter misses its SLOs whenever traffic comes in above it. So by default each
    hour is planned for its interactive forecast raised by the forecast's own backtest
    MAPE (`--headroom mape`; or a fraction, 0 for none).

NOTE: batch hours
    Batch lines go to the troughs: in each 24-hour block of the horizon, the hours whose
    interactive need is the block's least, and at least `min_batch_hours` of them (the
    quietest first). The block's forecast batch lines are spread evenly over them; those
    hours are searched again with batch arrivals at that rate added and batch held to a
    first token within `window_s` (the fleet keeps up with them), so a trough's replicas
    include its batch work.

NOTE: pre-warm
    Capacity for hour k must be ready `prewarm` before k starts. Hour h overlaps that
    lead for every k with k - prewarm < h + 1, so hour h runs the most any of hours
    h .. h + ceil(prewarm / 1 h) needs, per pool. The schedule repeats, so the last hours
    look ahead into the first.
"""

import math
import random
import sys
import time
from dataclasses import dataclass, replace

from tierserve.errors import ConfigError
from tierserve.schedule import HourPlan, Schedule
from tierserve.sim.plan import Cell, Planner
from tierserve.sim.workload import SimRequest

INTERACTIVE = ("priority", "default", "flex")
HOUR_S = 3600.0


@dataclass(frozen=True)
class HourTraffic:
    rate: float
    """Interactive requests/s."""
    shares: tuple[tuple[str, float], ...]
    """(tier, share of the interactive requests)."""
    prompt: float
    output: float
    """Mean tokens of an interactive request."""
    batch_lines: float = 0.0
    """Batch lines forecast in the hour."""
    batch_prompt: float = 256.0
    batch_output: float = 128.0


@dataclass
class Need:
    """The winning configuration of one (rounded) hour."""

    cell: Cell
    replicas: int
    attainment: float
    """The worst SLO tier's attainment in the run that decided (bracketed: the heavier
    end's)."""
    priority_e2e_s: float | None = None
    """Median end-to-end time of priority requests in that run (for the reserve)."""
    simulated: bool = True
    """False: bracketed between two searched hours of the same answer."""

    def reserved_priority_seqs(self, rate: float, share: float) -> int:
        """Little's law: priority requests in flight per replica, rounded up to a power of
        two (few distinct settings: fewer changes for a server to apply), below
        max_num_seqs; 0 without priority traffic."""
        if not self.priority_e2e_s or not rate * share:
            return 0
        busy = rate * share / self.replicas * self.priority_e2e_s
        return min(2 ** math.ceil(math.log2(max(busy, 1.0))), self.cell.max_num_seqs - 1)


def forecast_error(doc: dict) -> float:
    """The forecast's backtest MAPE of interactive requests (mean over the tiers, weighted
    by their requests; 0 where nothing was scored)."""
    weights = {t: sum(doc["tiers"][t]["requests"]) for t in INTERACTIVE if t in doc["tiers"]}
    scores = {t: (doc["tiers"][t]["models"].get("requests") or {}).get("mape") or 0.0
              for t in weights}
    total = sum(weights.values())
    return sum(scores[t] * w for t, w in weights.items()) / total if total else 0.0


def traffic_from_forecast(doc: dict, headroom: float = 0.0) -> list[HourTraffic]:
    """Each forecast hour's traffic (forecast/cli.py's document), its interactive
    requests raised by `headroom` (0.1: plan for 10% more than forecast)."""
    tiers = doc["tiers"]
    out = []
    for i in range(doc["horizon_hours"]):
        counts = {t: tiers[t]["requests"][i] for t in INTERACTIVE if t in tiers}
        total = sum(counts.values())
        tokens = [sum(tiers[t][s][i] for t in counts) / total if total else 0.0
                  for s in ("prompt_tokens", "output_tokens")]
        shares = tuple((t, c / total) for t, c in counts.items()) if total else ()
        batch = tiers.get("batch")
        lines = batch["requests"][i] if batch else 0.0
        out.append(HourTraffic(
            total * (1 + headroom) / HOUR_S, shares, tokens[0] or 256.0, tokens[1] or 128.0,
            lines,
            *((batch["prompt_tokens"][i] / lines, batch["output_tokens"][i] / lines)
              if lines else (256.0, 128.0))))
    return out


def window(traffic: HourTraffic, seconds: float, batch_rate: float = 0.0,
           seed: int = 0) -> list[SimRequest]:
    """`seconds` of the hour's arrivals (see the module's note), batch lines included."""
    rng = random.Random(seed)
    tiers = [t for t, _ in traffic.shares]
    weights = [s for _, s in traffic.shares]

    def length(mean: float) -> int:
        return max(1, round(rng.uniform(0.5 * mean, 1.5 * mean)))

    out = []
    for rate, batch in ((traffic.rate, False), (batch_rate, True)):
        t = rng.expovariate(rate) if rate > 0 else seconds
        while t < seconds:
            tier = "batch" if batch else rng.choices(tiers, weights)[0]
            prompt, output = (traffic.batch_prompt, traffic.batch_output) if batch else \
                (traffic.prompt, traffic.output)
            out.append(SimRequest(t, tier, length(prompt), length(output)))
            t += rng.expovariate(rate)
    return sorted(out, key=lambda r: r.arrival_s)


def prewarmed(needs: list[int], lead_hours: int) -> list[int]:
    """Each hour's capacity: the most needed over it and the next `lead_hours` (wrapping:
    the schedule repeats)."""
    n = len(needs)
    return [max(needs[(h + j) % n] for j in range(lead_hours + 1)) for h in range(n)]


def lead_hours(prewarm_s: float, hour_s: float = HOUR_S) -> int:
    return math.ceil(prewarm_s / hour_s - 1e-9) if prewarm_s > 0 else 0


class HourlyPlanner:
    def __init__(self, planner: Planner, cells: list[Cell], max_replicas: int,
                 window_s: float = 5.0, grid: float = 0.1, min_batch_hours: int = 6,
                 seed: int = 0):
        if window_s <= 0 or grid <= 0 or min_batch_hours < 1 or max_replicas < 1:
            raise ConfigError("need window_s > 0, grid > 0, min_batch_hours >= 1 and "
                              "max_replicas >= 1")
        self.planner, self.max_replicas = planner, max_replicas
        self.cells = sorted(cells, key=lambda c: (-c.max_num_seqs, c.max_num_batched_tokens))
        self.window_s, self.grid, self.seed = window_s, grid, seed
        self.min_batch_hours = min_batch_hours
        self._cache: dict[tuple, Need] = {}
        self._floors: dict[Cell, list[tuple[float, float, int]]] = {c: [] for c in cells}
        self.min_replicas = replace(planner.fleet, deployment=cells[0].deployment).min_replicas

    @property
    def searches(self) -> tuple[int, int]:
        """Distinct (rounded) hours so far: searched, and bracketed without a search."""
        simulated = sum(n.simulated for n in self._cache.values())
        return simulated, len(self._cache) - simulated

    def _up(self, x: float) -> float:
        """`x` rounded up to the geometric grid."""
        step = math.log1p(self.grid)
        return math.exp(math.ceil(math.log(x) / step - 1e-9) * step) if x > 0 else 0.0

    def rounded(self, traffic: HourTraffic, batch_rate: float) -> tuple:
        return (self._up(traffic.rate), self._up(batch_rate),
                tuple((t, round(s * 20) / 20) for t, s in traffic.shares),
                *(self._up(v) for v in (traffic.prompt, traffic.output, traffic.batch_prompt,
                                        traffic.batch_output)))

    def need(self, traffic: HourTraffic, batch_rate: float = 0.0) -> Need:
        """The hour's configuration (see the module's note), cached by rounded traffic."""
        return self.need_key(self.rounded(traffic, batch_rate))

    def need_key(self, key: tuple) -> Need:
        if key not in self._cache:
            self._cache[key] = self._search(key)
        return self._cache[key]

    def _search(self, key: tuple) -> Need:
        rate, batch_rate, shares = key[:3]
        if rate == 0 and batch_rate == 0:
            return Need(self.cells[0], self.min_replicas, 1.0)
        traffic = HourTraffic(rate, shares, *key[3:5], 0.0, *key[5:])
        workload = window(traffic, self.window_s, batch_rate, self.seed)
        slo = dict(self.planner.slo)
        if batch_rate:
            slo["batch"] = (self.window_s, None)
        best = None
        for cell in self.cells:  # the preferred first: later ones must beat it to win
            # Lighter hours bound the search from below: what they needed, and one more
            # than what failed them.
            floor = max((n for r, b, n in self._floors[cell] if r <= rate and b <= batch_rate),
                        default=self.min_replicas)
            # A later cell is tried only at one replica fewer than the best so far (if that
            # misses, fewer would too): ties go to the preferred cell unsimulated.
            low, top = (floor, self.max_replicas) if best is None else \
                (max(floor, best[2] - 1), best[2] - 1)
            for replicas in range(low, top + 1):
                summary = self.planner.simulate(cell, replicas, workload, slo)
                worst = -1.0 if summary is None else min(
                    (t["slo_attainment"] for tier, t in summary["tiers"].items()
                     if tier in slo), default=1.0)
                if worst < self.planner.attainment:
                    self._floors[cell].append((rate, batch_rate, replicas + 1))
                else:
                    self._floors[cell].append((rate, batch_rate, replicas))
                    rank = (replicas, -cell.max_num_seqs, cell.max_num_batched_tokens)
                    if best is None or rank < best[0]:
                        best = (rank, cell, replicas, worst, summary)
                    break
        if best is None:
            raise ConfigError(
                f"an hour of {rate:.1f} interactive req/s" + (f" and {batch_rate:.1f} batch "
                                                              f"lines/s" if batch_rate else "")
                + f": no configuration meets every SLO within {self.max_replicas} replicas; "
                  "raise --max-replicas or relax --slo")
        _, cell, replicas, worst, summary = best
        return Need(cell, replicas, worst,
                    summary["tiers"].get("priority", {}).get("e2e_p50_s"))

    def bracket(self, keys: list[tuple]) -> None:
        """Search `keys` (rounded hours of one batch rate), skipping those bracketed: both
        ends of a run are searched; where they agree, every hour between takes their
        answer unsimulated (need is monotone in the rate), else the run is halved."""
        keys = sorted(set(keys))
        runs = [(0, len(keys) - 1)] if keys else []
        while runs:
            lo, hi = runs.pop()
            a, b = self.need_key(keys[lo]), self.need_key(keys[hi])
            if hi - lo < 2:
                continue
            if (a.cell, a.replicas) == (b.cell, b.replicas):
                for key in keys[lo + 1:hi]:
                    self._cache.setdefault(key, replace(b, simulated=False))
            else:
                mid = (lo + hi) // 2
                runs += [(mid, hi), (lo, mid)]

    # ----------------------------------------------------------------- the schedule
    def batch_hours(self, hours: list[HourTraffic], needs: list[int]) -> list[bool]:
        """Per 24-hour block, its troughs (see the module's note)."""
        out = [False] * len(hours)
        for start in range(0, len(hours), 24):
            block = range(start, min(start + 24, len(hours)))
            least = min(needs[h] for h in block)
            quiet = sorted(block, key=lambda h: (needs[h] > least, hours[h].rate, h))
            chosen = [h for h in quiet if needs[h] == least]
            chosen += quiet[len(chosen):max(len(chosen), self.min_batch_hours)]
            for h in chosen:
                out[h] = True
        return out

    def plan(self, hours: list[HourTraffic], prewarm_s: float, step_cap_s: float | None,
             start_unix: float) -> Schedule:
        self.bracket([self.rounded(t, 0.0) for t in hours])
        needs = [self.need(t) for t in hours]
        batch = self.batch_hours(hours, [n.replicas for n in needs])
        batch_rate = [0.0] * len(hours)
        for start in range(0, len(hours), 24):
            block = range(start, min(start + 24, len(hours)))
            slots = [h for h in block if batch[h]]
            for h in slots:
                batch_rate[h] = sum(hours[b].batch_lines for b in block) / (len(slots) * HOUR_S)
        by_batch: dict[float, list[tuple]] = {}
        for h in range(len(hours)):
            if batch_rate[h]:
                key = self.rounded(hours[h], batch_rate[h])
                by_batch.setdefault(key[1], []).append(key)
        for keys in by_batch.values():
            self.bracket(keys)
        needs = [self.need(t, r) for t, r in zip(hours, batch_rate)]
        pools = self._pools(needs)
        ready = {pool: prewarmed(counts, lead_hours(prewarm_s)) for pool, counts in pools.items()}
        fleets = [(tuple(ready[p][h] for p in pools), n.cell) for h, n in enumerate(needs)]
        reserve: dict[tuple, int] = {}
        for fleet, t, n in zip(fleets, hours, needs):
            want = n.reserved_priority_seqs(t.rate, dict(t.shares).get("priority", 0.0))
            reserve[fleet] = max(reserve.get(fleet, 0), want)
        plans = []
        for h, (t, n) in enumerate(zip(hours, needs)):
            plans.append(HourPlan(
                replicas={p: ready[p][h] for p in pools}, need={p: pools[p][h] for p in pools},
                max_num_seqs=n.cell.max_num_seqs,
                max_num_batched_tokens=n.cell.max_num_batched_tokens,
                reserved_priority_seqs=reserve[fleets[h]], priority_step_time_s=step_cap_s,
                batch=batch[h], rate=t.rate, batch_rate=batch_rate[h]))
        return Schedule(start_unix, plans, HOUR_S, prewarm_s, self.cells[0].hardware,
                        self.planner.shape.name, self.planner.tp, self.cells[0].deployment,
                        dict(self.planner.slo), self.planner.attainment)

    def _pools(self, needs: list[Need]) -> dict[str, list[int]]:
        if self.cells[0].deployment == "dedicated":
            fast = self.planner.fleet.dedicated_replicas
            return {"fast": [fast] * len(needs), "main": [n.replicas - fast for n in needs]}
        return {"main": [n.replicas for n in needs]}


def render(schedule: Schedule, price_per_hour: float, searches: tuple[int, int],
           simulations: int, wall_s: float) -> str:
    from tierserve.tables import table

    lines = [f"schedule for {len(schedule.hours)} hours on {schedule.hardware} "
             f"({schedule.deployment}), pre-warm {schedule.prewarm_s / 60:g} min; "
             f"{sum(searches)} distinct hours: {searches[0]} searched in {simulations} "
             f"simulations, {searches[1]} bracketed; {wall_s:.1f} s", ""]
    head = ("hour", "req/s", "batch/s", "need", "replicas", "max_num_seqs", "budget",
            "reserved", "batch")
    rows = [(str(i), f"{h.rate or 0:.1f}", f"{h.batch_rate:.1f}",
             "+".join(str(v) for v in h.need.values()),
             "+".join(str(v) for v in h.replicas.values()), str(h.max_num_seqs),
             str(h.max_num_batched_tokens), str(h.reserved_priority_seqs),
             "yes" if h.batch else "-") for i, h in enumerate(schedule.hours)]
    lines += table(head, rows)
    used = sum(h.total_replicas for h in schedule.hours)
    peak = max(h.total_replicas for h in schedule.hours) * len(schedule.hours)
    lines += ["", f"replica-hours {used} against {peak} for the peak fleet all the time "
                  f"({1 - used / peak:.0%} fewer): ${used * price_per_hour:,.2f} against "
                  f"${peak * price_per_hour:,.2f}"]
    return "\n".join(lines)


def run(args, planner: Planner, cells: list[Cell]) -> int:
    """`plan --forecast FILE`: plan, print, and write `--out`."""
    from tierserve.forecast.cli import read_forecast
    from tierserve.sim.fleet import step_time_limit
    from tierserve.schedule import save_schedule

    doc = read_forecast(args.forecast)
    try:
        headroom = forecast_error(doc) if args.headroom == "mape" else float(args.headroom)
    except ValueError:
        headroom = -1.0
    if headroom < 0:
        raise ConfigError(f"--headroom must be a fraction >= 0 or mape, got {args.headroom}")
    hours = traffic_from_forecast(doc, headroom)
    hourly = HourlyPlanner(planner, cells, args.max_replicas, args.window_s,
                           min_batch_hours=args.min_batch_hours)
    started = time.perf_counter()
    cap = step_time_limit(planner.machine(cells[0].hardware).model, planner.slo)
    schedule = hourly.plan(hours, parse_duration(args.prewarm), cap or None,
                           float(doc["start_unix"]))
    wall = time.perf_counter() - started
    price = planner.machine(cells[0].hardware).price_per_hour
    print(f"planning for the forecast + {headroom:.1%} headroom"
          + (" (its backtest MAPE)" if args.headroom == "mape" else ""))
    print(render(schedule, price, hourly.searches, planner.num_simulations, wall))
    if args.out:
        save_schedule(schedule, args.out)
        print(f"plan: wrote {args.out}", file=sys.stderr)
    return 0


def parse_duration(text: str) -> float:
    """`30m`, `1h`, `90s`, `0` -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    text = text.strip()
    try:
        return float(text[:-1]) * units[text[-1]] if text[-1:] in units else float(text)
    except ValueError:
        raise ConfigError(f"--prewarm wants a duration (30m, 1h, 0), got {text!r}") from None
