"""`tierserve forecast`: per tier, requests and tokens by hour for the next day or week,
from the ledger's history, with each series' backtest error beside the baseline's.

The forecast file (`--out forecast.json`, or .yaml) is what `tierserve plan --forecast`
reads:

    {"version": 1, "start": ISO, "start_unix": ..., "hour_s": 3600, "horizon_hours": 24,
     "source": ..., "history": {"start": ISO, "hours": N}, "holdout_hours": 48,
     "note": null or the too-little-history line,
     "tiers": {TIER: {"requests": [per hour], "prompt_tokens": [...],
                      "output_tokens": [...],
                      "models": {SERIES: {"model", "mape", "baseline_mape"}}}}}

Counts are per hour (requests/s is requests / 3600).
"""

import json
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import yaml

from tierserve.db import is_postgres, redact
from tierserve.errors import ConfigError
from tierserve.forecast.history import HOUR_S, SERIES, History, from_ledger
from tierserve.forecast.model import choose
from tierserve.tables import table

VERSION = 1


def parse_horizon(text: str) -> int:
    """`24h`, `7d`, `36` (hours) -> hours."""
    m = re.fullmatch(r"(\d+)([hd]?)", text.strip())
    if not m or int(m.group(1)) < 1:
        raise ConfigError(f"--horizon wants hours or days (24h, 7d), got {text!r}")
    return int(m.group(1)) * (24 if m.group(2) == "d" else 1)


def _iso(unix: float) -> str:
    return datetime.fromtimestamp(unix, timezone.utc).isoformat()


def make_forecast(history: History, horizon: int, holdout: int, source: str) -> dict:
    """The forecast document (see the module's docstring) from hourly history."""
    note, tiers = None, {}
    for tier, series in history.series.items():
        out = {"models": {}}
        for name in SERIES:
            c = choose(series[name], horizon, holdout)
            note = note or c.note
            out[name] = [round(float(v), 3) for v in c.forecast]
            out["models"][name] = {"model": c.model, "mape": c.mape,
                                   "baseline_mape": c.baseline_mape, "scores": c.scores}
        tiers[tier] = out
    return {"version": VERSION, "start": _iso(history.end_unix),
            "start_unix": history.end_unix, "hour_s": HOUR_S, "horizon_hours": horizon,
            "source": source,
            "history": {"start": _iso(history.start_unix), "hours": history.hours},
            "holdout_hours": holdout, "note": note, "tiers": tiers}


def read_forecast(path: str) -> dict:
    """A forecast file (JSON or YAML), checked enough for the planner to trust it."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the forecast {path}: {exc}") from None
    try:
        doc = json.loads(text) if text.lstrip().startswith("{") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: not a forecast file ({exc})") from None
    if not isinstance(doc, dict) or doc.get("version") != VERSION or "tiers" not in doc:
        raise ConfigError(f"{path}: not a `tierserve forecast` file (version {VERSION})")
    n = doc.get("horizon_hours")
    for tier, series in doc["tiers"].items():
        if any(len(series.get(s) or []) != n for s in SERIES):
            raise ConfigError(f"{path}: tier {tier} does not have {n} hours of each of "
                              f"{', '.join(SERIES)}")
    return doc


def render(doc: dict) -> str:
    lines = [f"forecast from {doc['source']}: {doc['history']['hours']} hours of history "
             f"from {doc['history']['start'][:16]}; {doc['horizon_hours']} hours from "
             f"{doc['start'][:16]} UTC"]
    if doc["note"]:
        lines.append(doc["note"])
    lines += [f"backtest on the last {doc['holdout_hours'] // 24} days (MAPE over hours "
              "with traffic):", ""]
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    rows = [(tier, name, m["model"], pct(m["mape"]), pct(m["baseline_mape"]))
            for tier, t in doc["tiers"].items() for name, m in t["models"].items()]
    lines += table(("tier", "series", "model", "MAPE", "seasonal-naive MAPE"), rows) + [""]
    tiers = list(doc["tiers"])
    head = ("hour (UTC)", *(f"{t} req/s" for t in tiers), "prompt tok/s", "output tok/s")
    rows = []
    for i in range(doc["horizon_hours"]):
        t = doc["tiers"]
        rows.append((_iso(doc["start_unix"] + i * HOUR_S)[:16].replace("T", " "),
                     *(f"{t[x]['requests'][i] / HOUR_S:.3f}" for x in tiers),
                     f"{sum(t[x]['prompt_tokens'][i] for x in tiers) / HOUR_S:.1f}",
                     f"{sum(t[x]['output_tokens'][i] for x in tiers) / HOUR_S:.1f}"))
    return "\n".join(lines + table(head, rows))


def run(args) -> int:
    from tierserve.metering.bill import parse_time

    target = args.database or args.ledger
    if args.database and not is_postgres(args.database):
        raise ConfigError(f"--database wants a postgresql:// URL, got {args.database!r}")
    horizon = parse_horizon(args.horizon)
    if args.backtest_days < 1:
        raise ConfigError("--backtest-days must be >= 1")
    now = time.time()
    started = time.perf_counter()
    history = from_ledger(target, parse_time(args.since, now), parse_time(args.until, now))
    source = redact(target) if is_postgres(target) else str(target)
    doc = make_forecast(history, horizon, 24 * args.backtest_days, source)
    print(json.dumps(doc, indent=1) if args.format == "json" else render(doc))
    if args.out:
        text = yaml.safe_dump(doc, sort_keys=False) if args.out.endswith((".yaml", ".yml")) \
            else json.dumps(doc, indent=1)
        Path(args.out).write_text(text)
    print(f"forecast: {len(doc['tiers'])} tiers in {time.perf_counter() - started:.1f} s"
          + (f"; wrote {args.out}" if args.out else ""), file=sys.stderr)
    return 0


def add_parser(sub) -> None:
    from tierserve.metering.ledger import default_path

    p = sub.add_parser("forecast", help="requests and tokens per tier by hour for the next "
                                        "day or week, from the ledger (seasonal models "
                                        "chosen by backtest)")
    p.add_argument("--ledger", default=str(default_path()),
                   help="SQLite ledger, or a postgresql:// URL (default: %(default)s)")
    p.add_argument("--database", default=None, metavar="postgresql://...",
                   help="a PostgreSQL ledger (instead of --ledger)")
    p.add_argument("--horizon", default="24h", help="how far ahead: 24h (default) or 7d")
    p.add_argument("--backtest-days", type=int, default=2,
                   help="last days held out to score the models (default 2)")
    p.add_argument("--since", default=None,
                   help="history from this time: ISO date/time (UTC), unix seconds or an "
                        "age (30d)")
    p.add_argument("--until", default=None,
                   help="history up to this time (default: the last whole hour)")
    p.add_argument("--out", default=None, metavar="FORECAST.json",
                   help="also write the forecast (JSON, or YAML for .yaml) for "
                        "`tierserve plan --forecast`")
    p.add_argument("--format", default="table", choices=["table", "json"])
    p.set_defaults(func=run)
