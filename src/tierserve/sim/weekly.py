"""A multi-day diurnal workload: a weekday with a morning peak and an afternoon shoulder,
a quieter weekend, hour-to-hour noise, and batch lines submitted in office hours.

    weekly:peak=180,swing=5,weekend=0.5,noise=0.1,peak_hour=10,priority=0.2,
           batch=300000,window=24,prompt=128-512,output=32-256,days=7,seed=0

NOTE: the rate curve
    Hour 0 is a Monday 00:00; days 5 and 6 are the weekend. The weekday shape over the
    hour of day x is
        shape(x) = trough + (1 - trough) * max(g(x - peak_hour, 2), 0.8 g(x - peak_hour - 5, 3))
    with g(d, s) = exp(-d^2 / 2 s^2) on the circular distance d and trough = 1 / swing: 1 at
    the morning peak, 1/swing at night. An hour's mean interactive rate is
    peak * shape * (weekend on weekends) * a log-normal factor of mean 1 and spread `noise`,
    drawn from (seed, hour) alone, so any hour can be drawn without the ones before it.
    Within an hour arrivals are Poisson at that rate; `priority` of them are priority, the
    rest default. Batch lines (`batch` per weekday, `weekend` x that per weekend day) are
    submitted evenly from 9:00 to 17:00, each with a completion window of `window` hours.

Simulating a week of H100 traffic request by request is too slow for a laptop, so the
replay (sim/replay.py) draws each hour as a short window at the hour's rate (`draw()`)
and scales it to the hour.
"""

import math
import random
from dataclasses import dataclass, fields

from tierserve.errors import ConfigError
from tierserve.sim.workload import SimRequest, parse_spec

HOUR_S = 3600.0
BATCH_HOURS = range(9, 17)  # submissions, hours of day


def _bump(d: float, width: float) -> float:
    d = (d + 12) % 24 - 12  # circular distance in hours
    return math.exp(-0.5 * (d / width) ** 2)


@dataclass(frozen=True)
class WeeklyProfile:
    peak: float = 180.0
    """Weekday peak interactive requests/s (before noise)."""
    swing: float = 5.0
    """Weekday peak / night trough."""
    peak_hour: float = 10.0
    """Hour of day of the morning peak."""
    weekend: float = 0.5
    """Weekend rates (and batch submissions) x the weekday's."""
    noise: float = 0.1
    """Spread (sigma of the log) of the hourly rate factor."""
    priority: float = 0.2
    """Share of interactive requests in the priority tier (the rest: default)."""
    batch: float = 0.0
    """Batch lines submitted per weekday, from 9:00 to 17:00."""
    window: float = 24.0
    """Completion window of a batch line, hours."""
    prompt: tuple[int, int] = (128, 512)
    output: tuple[int, int] = (32, 256)
    days: int = 7
    seed: int = 0

    def validate(self) -> None:
        if self.peak <= 0 or self.swing < 1 or not 0 <= self.priority <= 1:
            raise ConfigError("weekly workload: need peak > 0, swing >= 1, 0 <= priority <= 1")
        if self.weekend < 0 or self.noise < 0 or self.batch < 0 or self.window < 1:
            raise ConfigError("weekly workload: need weekend, noise, batch >= 0, window >= 1")
        if self.days < 1 or not 1 <= self.prompt[0] <= self.prompt[1] \
                or not 1 <= self.output[0] <= self.output[1]:
            raise ConfigError("weekly workload: need days >= 1 and lo-hi token ranges >= 1")

    @property
    def hours(self) -> int:
        return 24 * self.days

    def shape(self, hour_of_day: float) -> float:
        trough = 1 / self.swing
        bump = max(_bump(hour_of_day - self.peak_hour, 2.0),
                   0.8 * _bump(hour_of_day - self.peak_hour - 5, 3.0))
        return trough + (1 - trough) * bump

    def mean_rate(self, hour: int) -> float:
        """The hour's rate before noise (hour 0: Monday 00:00; negative hours: before)."""
        weekend = self.weekend if (hour // 24) % 7 >= 5 else 1.0
        return self.peak * self.shape(hour % 24 + 0.5) * weekend

    def rate(self, hour: int) -> float:
        """The hour's interactive requests/s, noise included (seeded by seed and hour)."""
        if not self.noise:
            return self.mean_rate(hour)
        z = random.Random(f"{self.seed}:{hour}").gauss(0.0, self.noise)
        return self.mean_rate(hour) * math.exp(z - self.noise ** 2 / 2)

    def batch_lines(self, hour: int) -> float:
        """Batch lines submitted in the hour."""
        if hour % 24 not in BATCH_HOURS:
            return 0.0
        weekend = self.weekend if (hour // 24) % 7 >= 5 else 1.0
        return self.batch * weekend / len(BATCH_HOURS)

    def mean_tokens(self) -> tuple[float, float]:
        return sum(self.prompt) / 2, sum(self.output) / 2

    def draw(self, rate: float, seconds: float, batch_rate: float = 0.0,
               seed: int = 0) -> list[SimRequest]:
        """`seconds` of Poisson arrivals at `rate` interactive requests/s (priority share
        as the profile's) plus `batch_rate` batch lines/s, sorted by arrival."""
        rng = random.Random(seed)
        out = []
        for tier_rate, batch in ((rate, False), (batch_rate, True)):
            t = rng.expovariate(tier_rate) if tier_rate > 0 else seconds
            while t < seconds:
                tier = "batch" if batch else \
                    "priority" if rng.random() < self.priority else "default"
                out.append(SimRequest(t, tier, rng.randint(*self.prompt),
                                      rng.randint(*self.output)))
                t += rng.expovariate(tier_rate)
        return sorted(out, key=lambda r: r.arrival_s)


def parse_weekly(spec: str) -> WeeklyProfile:
    """`weekly:key=value,...` (see the module's docstring) -> WeeklyProfile."""
    kind, _, opts = parse_spec(spec)
    if kind != "weekly":
        raise ConfigError(f"expected a weekly:... workload, got {spec!r}")
    known = {f.name: f.type for f in fields(WeeklyProfile)}
    values = {}
    for key, text in opts.items():
        if key not in known:
            raise ConfigError(f"weekly workload: unknown key {key!r}; keys: "
                              f"{', '.join(known)}")
        try:
            if key in ("prompt", "output"):
                lo, _, hi = text.partition("-")
                values[key] = (int(lo), int(hi or lo))
            else:
                values[key] = int(text) if key in ("days", "seed") else float(text)
        except ValueError:
            raise ConfigError(f"weekly workload: bad value {key}={text!r}") from None
    profile = WeeklyProfile(**values)
    profile.validate()
    return profile
