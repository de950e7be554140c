"""A ledger's history as hourly series: per tier, requests, prompt tokens and output
tokens in each UTC hour.

NOTE: what an hour counts
    A request counts in the hour it arrived (finish time less its end-to-end time, as the
    simulator's ledger replay reads it), in the tier that served it, whatever its finish
    reason: refused and aborted requests were demand too. The series run from the hour of
    the first arrival to `until` (default: the hour after the last arrival, but never the
    hour now under way, which is not over). An hour with no rows is a zero, not a gap: a
    quiet night is data, and the models need evenly spaced points.
"""

import math
import os
import time
from dataclasses import dataclass

import numpy as np

from tierserve.db import is_postgres
from tierserve.errors import ConfigError
from tierserve.tiers import TIER_NAMES

HOUR_S = 3600
SERIES = ("requests", "prompt_tokens", "output_tokens")


@dataclass
class History:
    start_unix: float
    """Start of the first hour (a whole UTC hour)."""
    series: dict[str, dict[str, np.ndarray]]
    """tier -> series name (SERIES) -> one value per hour."""
    hours: int

    @property
    def end_unix(self) -> float:
        return self.start_unix + self.hours * HOUR_S


def from_rows(rows, until: float | None = None, now: float | None = None) -> History:
    """`rows`: (arrival_unix, tier, prompt_tokens, output_tokens) in any order."""
    rows = [r for r in rows if r[1] in TIER_NAMES]
    if not rows:
        raise ConfigError("the ledger has no requests to forecast from")
    arrivals = np.array([r[0] for r in rows], dtype=float)
    start = math.floor(arrivals.min() / HOUR_S) * HOUR_S
    if until is not None:
        end = math.floor(until / HOUR_S) * HOUR_S
    else:
        end = (math.floor(arrivals.max() / HOUR_S) + 1) * HOUR_S
        end = min(end, math.floor((time.time() if now is None else now) / HOUR_S) * HOUR_S)
    hours = int((end - start) // HOUR_S)
    if hours < 1:
        raise ConfigError("the ledger holds less than one finished hour of requests")
    index = ((arrivals - start) // HOUR_S).astype(int)
    keep = (index >= 0) & (index < hours)
    tiers = np.array([r[1] for r in rows])
    values = {"requests": np.ones(len(rows)),
              "prompt_tokens": np.array([r[2] for r in rows], dtype=float),
              "output_tokens": np.array([r[3] for r in rows], dtype=float)}
    series = {}
    for tier in TIER_NAMES:
        mask = keep & (tiers == tier)
        if mask.any():
            series[tier] = {name: np.bincount(index[mask], weights=v[mask], minlength=hours)
                            for name, v in values.items()}
    return History(float(start), series, hours)


def from_ledger(target: str, since: float | None = None, until: float | None = None,
                now: float | None = None) -> History:
    """The ledger at `target` (a SQLite file or a postgresql:// URL) as hourly series."""
    from tierserve.metering.ledger import connect

    if not is_postgres(target) and not os.path.isfile(target):
        raise ConfigError(f"no ledger at {target} (serve writes one; --ledger PATH)")
    db = connect(target)
    try:
        arrival = "time - COALESCE(e2e_s, 0)"
        rows = db.execute(
            f"SELECT {arrival}, tier_served, prompt_tokens, output_tokens FROM requests "
            f"WHERE {arrival} >= ? AND {arrival} < ?",
            (since if since is not None else -1e18,
             until if until is not None else 1e18)).fetchall()
    finally:
        db.close()
    return from_rows(rows, until, now)
