"""`tierserve forecast` (forecast/): a ledger's history as hourly series, seasonal models
chosen by backtest, gaps, too little history, and the file `plan --forecast` reads."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierserve.cli import main
from tierserve.forecast.cli import parse_horizon, read_forecast
from tierserve.forecast.history import from_ledger, from_rows
from tierserve.forecast.model import BASELINE, choose, mape, seasonal_naive
from tierserve.metering.ledger import connect
from tierserve.errors import ConfigError

DAY0 = 1_764_460_800  # 2025-11-30 00:00 UTC: a whole hour
COLUMNS = ("time, request_id, tenant, model, tier_requested, tier_served, prompt_tokens, "
           "cached_tokens, output_tokens, prefill_cost, decode_cost, charge, finish_reason, "
           "tags, e2e_s")


def daily(hour: int) -> int:
    """A known daily pattern: 4 requests at night, 40 at the 10:00 peak."""
    return round(4 + 36 * math.exp(-0.5 * ((hour % 24 - 10) / 3) ** 2))


def write_ledger(path, hours: int, skip=(), tiers=("default",), seed=0) -> int:
    """`hours` of the daily pattern (+-10% noise) from DAY0, none in hours of `skip`."""
    rng = np.random.default_rng(seed)
    rows = []
    for h in range(hours):
        if h in skip:
            continue
        for tier in tiers:
            n = max(0, round(daily(h) * rng.uniform(0.9, 1.1)))
            for i in range(n):
                arrival = DAY0 + h * 3600 + (i + 0.5) * 3600 / n
                rows.append((arrival + 2.0, f"{tier}-{h}-{i}", "t", "m", tier, tier, 200, 0,
                             50, 0.0, 0.0, 0.0, "stop", "{}", 2.0))
    db = connect(path)
    with db:
        db.executemany(f"INSERT INTO requests ({COLUMNS}) VALUES "
                       f"({', '.join('?' * len(COLUMNS.split(',')))})", rows)
    db.close()
    return len(rows)


def test_history_counts_arrivals_by_hour_and_gaps_are_zeros(tmp_path):
    path = tmp_path / "ledger.db"
    write_ledger(path, 48, skip=range(20, 26))
    h = from_ledger(str(path), now=DAY0 + 10 * 86400)
    assert h.start_unix == DAY0 and h.hours == 48
    requests = h.series["default"]["requests"]
    assert list(requests[20:26]) == [0] * 6  # an outage is zeros, not missing hours
    assert requests[10] > 30 and requests[3] < 8
    assert h.series["default"]["prompt_tokens"][10] == 200 * requests[10]
    # the hour under way is not history: it is not over
    assert from_ledger(str(path), now=DAY0 + 47.5 * 3600).hours == 47


def test_from_rows_rejects_empty_history():
    with pytest.raises(ConfigError, match="no requests"):
        from_rows([])


def test_forecast_beats_or_ties_the_baseline_and_prints_mape(tmp_path, capsys):
    path, out = tmp_path / "ledger.db", tmp_path / "forecast.json"
    write_ledger(path, 24 * 9, skip=range(100, 104))  # nine days, a 4-hour gap
    assert main(["forecast", "--ledger", str(path), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "MAPE" in text and "seasonal-naive MAPE" in text
    doc = read_forecast(str(out))
    assert doc["horizon_hours"] == 24 and doc["note"] is None
    m = doc["tiers"]["default"]["models"]["requests"]
    assert m["mape"] <= m["baseline_mape"] < 0.3
    forecast = np.array(doc["tiers"]["default"]["requests"])
    pattern = np.array([daily(h) for h in range(24)])  # the forecast starts at 00:00
    assert mape(pattern, forecast) < 0.25
    assert int(np.argmax(forecast)) in (9, 10, 11)


def test_too_little_history_falls_back_to_the_baseline(tmp_path, capsys):
    path = tmp_path / "ledger.db"
    write_ledger(path, 30)
    assert main(["forecast", "--ledger", str(path), "--horizon", "7d", "--format",
                 "json"]) == 0
    out = capsys.readouterr().out
    doc = json.loads(out)
    assert doc["note"].startswith("too little history: 30 hours")
    m = doc["tiers"]["default"]["models"]["requests"]
    assert m["model"] == BASELINE
    assert len(doc["tiers"]["default"]["requests"]) == 168
    # the table says it in one line
    assert main(["forecast", "--ledger", str(path)]) == 0
    table = capsys.readouterr().out
    assert sum("too little history" in line for line in table.splitlines()) == 1


def test_under_a_day_forecasts_the_mean():
    c = choose(np.array([5.0, 7.0, 6.0]), 4, 48)
    assert c.model == "mean" and list(c.forecast) == [6.0] * 4 and c.mape is None


def test_cli_errors(tmp_path, capsys):
    assert main(["forecast", "--ledger", str(tmp_path / "none.db")]) == 1
    assert "no ledger" in capsys.readouterr().err
    assert main(["forecast", "--database", "sqlite:///x"]) == 1
    assert "postgresql" in capsys.readouterr().err
    with pytest.raises(ConfigError):
        parse_horizon("1w")
    assert parse_horizon("7d") == 168 and parse_horizon("36") == 36


@settings(max_examples=5, deadline=None)
@given(st.lists(st.integers(1, 500), min_size=24, max_size=24))
def test_a_daily_cycle_is_forecast_exactly(day):
    """On a series that repeats each day, the baseline is exact, so the chosen model
    must be too (a model wins only by beating it)."""
    y = np.array(day * 6, dtype=float)
    c = choose(y, 24, 48)
    assert c.mape is not None and c.mape <= c.baseline_mape == 0.0
    assert np.allclose(c.forecast, day, rtol=1e-6, atol=1e-6)


def test_seasonal_naive_uses_the_week_when_it_has_one():
    y = np.arange(24 * 8, dtype=float)
    assert list(seasonal_naive(y, 3)) == list(y[-168:-165])
    assert list(seasonal_naive(y[:30], 26)) == list(y[6:30]) + list(y[6:8])
