"""Forecast and schedule on a simulated week (issue 19): forecast a week of traffic from
three weeks of history, plan it hour by hour, and replay a fresh week (other noise) on the
schedule, on the cheapest static fleet meeting the SLOs at the peak and on the static
fleet sized for the mean.

    python benchmarks/diurnal.py [--peak 180] [--swing 5] [--weekend 0.5] [--noise 0.1]
                                 [--batch 300000] [--history-days 21] [--days 7]
                                 [--window-s 5] [--prewarm 30m] [--headroom mape]
                                 [--attainment 0.99] [--hardware h100-sxm]
                                 [--model llama-3-8b] [--slo priority=0.2,0.03 ...]

The history is the weekly profile's hourly counts (Poisson draws around its noisy rates,
seed 1) fed straight to the forecaster: a ledger of three weeks at this rate would hold
about 200 million rows (`tierserve forecast --ledger` reads the same series from one; the
tests cover that path). The replayed week is seed 2. Each hour is simulated as a
`--window-s` window scaled to the hour (sim/replay.py). Prints one line: the config, the
forecast's backtest MAPE beside the seasonal-naive baseline's, and per fleet its cost and
per-tier SLO attainment, with the batch lines done inside their window.
"""

import argparse
import sys
import time

import numpy as np

from tierserve.forecast.cli import make_forecast
from tierserve.forecast.history import History
from tierserve.model.metadata import resolve
from tierserve.sim.cli import parse_slo
from tierserve.sim.fleet import machine_for, step_time_limit
from tierserve.sim.hourly import (
    HourlyPlanner,
    forecast_error,
    parse_duration,
    traffic_from_forecast,
)
from tierserve.sim.plan import Cell, Planner
from tierserve.sim.replay import Replay, compare
from tierserve.sim.weekly import WeeklyProfile


def history(profile: WeeklyProfile, days: int, seed: int = 0) -> History:
    """`days` of hourly counts before hour 0 (hour 0 is a Monday 00:00)."""
    rng = np.random.default_rng(seed)
    hours = range(-24 * days, 0)
    prompt, output = profile.mean_tokens()
    requests = np.array([rng.poisson(profile.rate(h) * 3600) for h in hours], dtype=float)
    priority = rng.binomial(requests.astype(int), profile.priority).astype(float)
    series = {tier: {"requests": n, "prompt_tokens": n * prompt, "output_tokens": n * output}
              for tier, n in (("priority", priority), ("default", requests - priority))}
    lines = np.array([profile.batch_lines(h) for h in hours])
    if lines.any():
        series["batch"] = {"requests": lines, "prompt_tokens": lines * prompt,
                           "output_tokens": lines * output}
    return History(-24 * days * 3600.0, series, 24 * days)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peak", type=float, default=180.0)
    p.add_argument("--swing", type=float, default=5.0)
    p.add_argument("--weekend", type=float, default=0.5)
    p.add_argument("--noise", type=float, default=0.1)
    p.add_argument("--batch", type=float, default=300_000, help="batch lines per weekday")
    p.add_argument("--history-days", type=int, default=21)
    p.add_argument("--days", type=int, default=7)
    p.add_argument("--window-s", type=float, default=5.0)
    p.add_argument("--prewarm", default="30m")
    p.add_argument("--headroom", default="mape", help="as plan --headroom (mape)")
    p.add_argument("--attainment", type=float, default=0.99)
    p.add_argument("--hardware", default="h100-sxm")
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--max-replicas", type=int, default=12)
    p.add_argument("--slo", action="append", default=None)
    args = p.parse_args(argv)
    slo = parse_slo(args.slo or ["priority=0.2,0.03", "default=2,0.1"])
    started = time.perf_counter()

    past = WeeklyProfile(peak=args.peak, swing=args.swing, weekend=args.weekend,
                         noise=args.noise, batch=args.batch, seed=1)
    doc = make_forecast(history(past, args.history_days), 24 * args.days, 48, "synthetic")
    t_forecast = time.perf_counter() - started

    shape = resolve(args.model)
    planner = Planner(shape, slo, args.attainment)
    hourly = HourlyPlanner(planner, [Cell(args.hardware, "shared", 256, 2048)],
                           args.max_replicas, args.window_s)
    cap = step_time_limit(planner.machine(args.hardware).model, slo)
    headroom = forecast_error(doc) if args.headroom == "mape" else float(args.headroom)
    schedule = hourly.plan(traffic_from_forecast(doc, headroom), parse_duration(args.prewarm),
                           cap, doc["start_unix"])
    t_plan = time.perf_counter() - started - t_forecast

    week = WeeklyProfile(peak=args.peak, swing=args.swing, weekend=args.weekend,
                         noise=args.noise, batch=args.batch, days=args.days, seed=2)
    replay = Replay(week, machine_for(shape, args.hardware), slo, args.window_s)
    outcomes = compare(schedule, week, replay, hourly)
    wall = time.perf_counter() - started

    models = {t: doc["tiers"][t]["models"]["requests"] for t in ("priority", "default")}
    mape = " ".join(f"{t} {m['model']} {100 * m['mape']:.1f}% vs naive "
                    f"{100 * m['baseline_mape']:.1f}%" for t, m in models.items())
    s, peak, mean = outcomes
    fleets = " | ".join(
        f"{o.name} ${o.cost:,.0f} " + " ".join(f"{t} {100 * o.attainment(t):.2f}%"
                                               for t in o.expected)
        + f" batch on time {100 * o.batch_on_time / max(o.batch_lines, 1):.1f}% (late "
          f"{o.batch_late:,.0f})"
        for o in (s, peak, mean))
    print(f"diurnal peak={args.peak:g} swing={args.swing:g} weekend={args.weekend:g} "
          f"noise={args.noise:g} batch={args.batch:g}/weekday history={args.history_days}d "
          f"days={args.days} window={args.window_s:g}s prewarm={args.prewarm} "
          f"headroom={headroom:.3f} "
          f"attainment={args.attainment:g} {args.model} on {args.hardware} "
          + " ".join(f"slo {t}={a},{b}" for t, (a, b) in slo.items())
          + f" | forecast MAPE (requests, held-out 2 days): {mape} | {fleets} | schedule "
          f"{1 - s.cost / peak.cost:.1%} cheaper than {peak.name}; batch in its batch hours "
          f"{100 * s.batch_in_batch_hours / max(s.batch_lines, 1):.1f}% | wall "
          f"{wall:.0f} s (forecast {t_forecast:.0f}, plan {t_plan:.0f}, replay "
          f"{wall - t_forecast - t_plan:.0f}; {replay.num_windows} windows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
