"""`tierserve sim --schedule FILE`: a schedule replayed on a multi-day diurnal workload
(sim/weekly.py), beside the cheapest static fleet that meets the SLOs at the peak and the
static fleet sized for the mean.

NOTE: how a week is simulated
    Hour by hour: an hour is a `window_s` window of its arrivals (WeeklyProfile.draw at
    the hour's rate, noise included, rounded to the nearest 5% step) run on the hour's
    fleet, and its results are scaled to the hour. The fleet is paid for the whole hour,
    busy or not; each SLO tier's attainment in the window counts with the hour's expected
    requests of that tier. Hours alike (same rounded rate, fleet and batch rate) share one
    run: the window is seeded, so they would give the same result anyway. And load is
    taken to be monotone: once an hour on a fleet met every target with every batch line
    started, a lighter hour on that fleet (no more requests, no more batch lines) is taken
    to as well, unsimulated; each fleet's busiest hours are run first to find such a
    bound. Workload hour h is schedule entry h (the schedule repeats).

    The static fleets are searched like a schedule's hours (sim/hourly.py) with the
    schedule's settings at its busiest hour: the peak fleet at the week's highest hourly
    rate (known in hindsight, which favours it), the mean fleet at the mean rate.

NOTE: batch lines
    Lines queue by submission hour, oldest first, each due `window` hours after its
    submission hour. A static fleet runs what is queued at once. The schedule holds lines
    for its batch hours: outside them it releases only lines that would be late if they
    waited for the next batch hour; in a batch hour, the queue divided by the batch hours
    left in the run (or more, if more are due). The lines released in an hour arrive in
    its window at released / 3600 per second; the share of them started by the window's
    end is done in the hour, the rest go back to the queue. A line done in hour h is
    inside its window if h + 1 <= its submission hour + `window`. Lines submitted late in
    the week run on in the hours after it (counted for batch only) until done or due.
"""

import math
import sys
import time
from dataclasses import dataclass, field, replace

from tierserve.config import SchedulerConfig
from tierserve.schedule import HourPlan, Schedule
from tierserve.sim.fleet import FleetConfig, Machine, make_simulator, step_time_limit
from tierserve.sim.report import summarize
from tierserve.sim.weekly import HOUR_S, WeeklyProfile
from tierserve.tables import table
from tierserve.tiers import Tier

RATE_STEP = 0.1


@dataclass(frozen=True)
class Fleet:
    """What an hour runs on."""

    replicas: int
    max_num_seqs: int
    max_num_batched_tokens: int
    reserved_priority_seqs: int
    step_cap_s: float | None


@dataclass
class Outcome:
    name: str
    replica_hours: int = 0
    cost: float = 0.0
    met: dict[str, float] = field(default_factory=dict)
    expected: dict[str, float] = field(default_factory=dict)
    """Per SLO tier: requests within both targets, and requests, summed over hours."""
    batch_lines: float = 0.0
    batch_on_time: float = 0.0
    batch_late: float = 0.0
    """Lines done after their window, or never."""
    batch_in_batch_hours: float = 0.0
    """Lines done in hours the schedule opened to batch."""

    def attainment(self, tier: str) -> float | None:
        return self.met[tier] / self.expected[tier] if self.expected.get(tier) else None


def fleet_of(hour: HourPlan) -> Fleet:
    return Fleet(hour.total_replicas, hour.max_num_seqs, hour.max_num_batched_tokens,
                 hour.reserved_priority_seqs, hour.priority_step_time_s)


def _nearest(x: float) -> float:
    if x <= 1e-6:
        return 0.0
    step = math.log1p(RATE_STEP)
    return math.exp(round(math.log(x) / step) * step)


class Replay:
    def __init__(self, profile: WeeklyProfile, machine: Machine, slo: dict,
                 window_s: float = 5.0, router: str = "least-tokens",
                 deployment: str = "shared", dedicated_replicas: int = 1):
        self.profile, self.machine, self.slo = profile, machine, slo
        self.window_s, self.router = window_s, router
        self.deployment, self.dedicated_replicas = deployment, dedicated_replicas
        self._runs: dict[tuple, tuple[dict, dict, float]] = {}
        self._perfect: dict[tuple, tuple[dict, dict, float]] = {}
        """Runs where every SLO tier met both targets and every batch line started."""

    @property
    def num_windows(self) -> int:
        return len(self._runs)

    def hour(self, rate: float, batch_rate: float, fleet: Fleet) -> tuple[dict, dict, float]:
        """One hour's window: per SLO tier (requests met, requests) and the share of the
        batch lines started by the window's end."""
        key = (_nearest(rate), _nearest(batch_rate), fleet)
        if key in self._runs:
            return self._runs[key]
        for (r, b, f), run in self._perfect.items():
            if f == fleet and r >= key[0] and b >= key[1]:
                return run  # a heavier hour on this fleet met everything: so does this one
        run = self._runs[key] = self._simulate(*key)
        met, _, done = run
        if done >= 1.0 and all(v >= 1.0 for v in met.values()):
            self._perfect[key] = run
        return run

    def bound(self, fleets: list[Fleet], batch_rate: float = 0.0) -> None:
        """Simulate each fleet's hours from the busiest down (at `batch_rate`) until one
        meets everything: it stands for every lighter hour of that fleet (see `hour`)."""
        p = self.profile
        for fleet in set(fleets):
            rates = sorted({_nearest(p.rate(h)) for h in range(p.hours)
                            if fleets[h % len(fleets)] == fleet}, reverse=True)
            for rate in rates:
                met, _, done = self.hour(rate, batch_rate, fleet)
                if done >= 1.0 and all(v >= 1.0 for v in met.values()):
                    break

    def _simulate(self, rate: float, batch_rate: float, fleet: Fleet):
        workload = self.profile.draw(rate, self.window_s, batch_rate, self.profile.seed)
        if not workload:
            return {}, {}, 1.0
        config = SchedulerConfig(max_num_seqs=fleet.max_num_seqs,
                                 max_num_batched_tokens=fleet.max_num_batched_tokens,
                                 reserved_priority_seqs=fleet.reserved_priority_seqs)
        shape = FleetConfig(replicas=fleet.replicas, router=self.router,
                            deployment=self.deployment,
                            dedicated_replicas=self.dedicated_replicas)
        cap = step_time_limit(self.machine.model, self.slo, fleet.step_cap_s)
        sim = make_simulator(self.machine, config, shape, cap or None, slo=self.slo)
        result = sim.run(workload)
        tiers = summarize(result, self.slo)["tiers"]
        met = {t: tiers[t]["slo_attainment"] for t in self.slo if t in tiers}
        interactive = sum(r.tier != "batch" for r in workload)
        share = {t: tiers[t]["requests"] / interactive for t in met}
        batch = [r for r in result.requests if r.tier == Tier.BATCH]
        started = sum(r.first_scheduled_time is not None
                      and r.first_scheduled_time <= self.window_s for r in batch)
        return met, share, started / len(batch) if batch else 1.0

    # ------------------------------------------------------------------ a week
    def run(self, name: str, fleets: list[Fleet], batch_hours: list[bool] | None) -> Outcome:
        """The week on `fleets` (one per hour, repeating). `batch_hours`: the schedule's
        batch entries (repeating); None: a static fleet, batch lines run as they come.
        Lines still queued at the week's end run on in the hours after it (the same
        schedule and traffic, not counted in cost or SLOs) until done or due."""
        p, out = self.profile, Outcome(name)
        self.bound(fleets, max(p.batch_lines(h) for h in range(p.hours)) / HOUR_S
                   if batch_hours is None else 0.0)
        queue: list[list[float]] = []  # [submission hour, lines], oldest first
        for h in range(p.hours + math.ceil(p.window)):
            if h >= p.hours and not queue:
                break
            fleet = fleets[h % len(fleets)]
            if h < p.hours:
                out.batch_lines += p.batch_lines(h)
                queue += [[h, p.batch_lines(h)]] if p.batch_lines(h) else []
                out.replica_hours += fleet.replicas
                out.cost += fleet.replicas * self.machine.price_per_hour
            released = self._release(queue, h, batch_hours)
            met, share, done = self.hour(p.rate(h), sum(n for _, n in released) / HOUR_S,
                                         fleet)
            for tier, attained in met.items() if h < p.hours else ():
                n = p.rate(h) * HOUR_S * share[tier]
                out.met[tier] = out.met.get(tier, 0.0) + attained * n
                out.expected[tier] = out.expected.get(tier, 0.0) + n
            opened = batch_hours is not None and batch_hours[h % len(batch_hours)]
            for s, n in released:
                on_time = h + 1 <= s + p.window
                out.batch_on_time += n * done if on_time else 0.0
                out.batch_late += 0.0 if on_time else n * done
                out.batch_in_batch_hours += n * done if opened else 0.0
            queue[:0] = [[s, n * (1 - done)] for s, n in released if done < 1.0]
        out.batch_late += sum(n for _, n in queue)  # never done
        return out

    def _release(self, queue: list[list[float]], h: int,
                 batch_hours: list[bool] | None) -> list[list[float]]:
        """Take this hour's lines off the front of `queue` (see the module's note)."""
        total = sum(n for _, n in queue)
        if batch_hours is None:
            amount = total
        else:
            n = len(batch_hours)
            ahead = [batch_hours[(h + i) % n] for i in range(n)]
            if ahead[0]:
                left = next((i for i, b in enumerate(ahead) if not b), n)
                due = sum(c for s, c in queue if s + self.profile.window < h + 2)
                amount = max(total / left, due)
            else:
                wait = next((i for i, b in enumerate(ahead) if b), None)
                wait = n if wait is None else wait  # no batch hour: lines run when due
                amount = sum(c for s, c in queue if s + self.profile.window < h + wait + 1)
        released = []
        while queue and amount > 1e-9:
            s, n = queue[0]
            take = min(n, amount)
            released.append([s, take])
            amount -= take
            if take >= n:
                queue.pop(0)
            else:
                queue[0][1] = n - take
        return released


def compare(schedule: Schedule, profile: WeeklyProfile, replay: Replay, hourly) -> list:
    """The schedule, the static peak fleet and the static mean fleet, replayed."""
    from tierserve.sim.hourly import HourTraffic

    busiest = max(schedule.hours, key=lambda h: (h.total_replicas, h.rate or 0))
    rates = [profile.rate(h) for h in range(profile.hours)]
    traffic = HourTraffic(0.0, (("priority", profile.priority),
                                ("default", 1 - profile.priority)), *profile.mean_tokens())
    static = []
    for label, rate in (("static peak", max(rates)), ("static mean", sum(rates) / len(rates))):
        need = hourly.need(replace(traffic, rate=rate))
        fleet = replace(fleet_of(busiest), replicas=need.replicas)
        static.append((f"{label} x{need.replicas}", [fleet]))
    outcomes = [replay.run("schedule", [fleet_of(h) for h in schedule.hours],
                           [h.batch for h in schedule.hours])]
    outcomes += [replay.run(name, fleets, None) for name, fleets in static]
    return outcomes


def render(outcomes: list[Outcome], config: str) -> str:
    pct = lambda v: "-" if v is None else f"{100 * v:.2f}%"  # noqa: E731
    tiers = list(outcomes[0].expected)
    head = ("fleet", "replica-hours", "cost $", *(f"{t} SLO" for t in tiers),
            "batch on time", "late")
    rows = [(o.name, str(o.replica_hours), f"{o.cost:,.2f}", *(pct(o.attainment(t))
                                                               for t in tiers),
             pct(o.batch_on_time / o.batch_lines if o.batch_lines else None),
             f"{o.batch_late:,.0f}") for o in outcomes]
    s, peak = outcomes[0], outcomes[1]
    lines = [config, ""] + table(head, rows) + [""]
    saved = 1 - s.cost / peak.cost
    lines.append(f"schedule vs {peak.name}: {abs(saved):.1%} "
                 f"{'cheaper' if saved >= 0 else 'dearer'}; SLO "
                 "attainment " + ", ".join(f"{t} {pct(s.attainment(t))} vs "
                                           f"{pct(peak.attainment(t))}" for t in tiers))
    if s.batch_lines:
        lines.append(f"batch: {s.batch_lines:,.0f} lines; the schedule ran "
                     f"{s.batch_in_batch_hours / s.batch_lines:.1%} of them in its batch "
                     f"hours, {s.batch_on_time / s.batch_lines:.1%} inside their window")
    return "\n".join(lines)


def run(args) -> int:
    """`tierserve sim --schedule FILE --workload weekly:...`."""
    from tierserve.model.metadata import resolve
    from tierserve.sim.fleet import machine_for
    from tierserve.sim.hourly import HourlyPlanner
    from tierserve.sim.plan import Cell, Planner
    from tierserve.schedule import load_schedule
    from tierserve.sim.weekly import parse_weekly

    schedule = load_schedule(args.schedule)
    profile = parse_weekly(args.workload or "weekly:")
    shape = resolve(schedule.model)
    machine = machine_for(shape, schedule.hardware, schedule.tp)
    started = time.perf_counter()
    replay = Replay(profile, machine, schedule.slo, args.window_s, args.router,
                    schedule.deployment, args.dedicated_replicas)
    planner = Planner(shape, schedule.slo, schedule.attainment, schedule.tp,
                      router=args.router, dedicated_replicas=args.dedicated_replicas)
    busiest = max(schedule.hours, key=lambda h: (h.total_replicas, h.rate or 0))
    hourly = HourlyPlanner(planner, [Cell(schedule.hardware, schedule.deployment,
                                          busiest.max_num_seqs,
                                          busiest.max_num_batched_tokens)],
                           args.max_replicas, args.window_s)
    outcomes = compare(schedule, profile, replay, hourly)
    print(f"sim: {replay.num_windows} windows in {time.perf_counter() - started:.1f} s of "
          "wall time", file=sys.stderr)
    print(render(outcomes, describe(args.schedule, args.workload, profile, args.window_s,
                                    machine)))
    return 0


def describe(path: str, spec: str | None, profile: WeeklyProfile, window_s: float,
             machine: Machine) -> str:
    return (f"replay of {path} on {spec or 'weekly:'} ({profile.days} days, "
            f"{machine.hardware} ${machine.price_per_hour:.2f}/h per replica): each hour "
            f"a {window_s:g} s window scaled to the hour (rates to the nearest "
            f"{RATE_STEP:.0%})")
