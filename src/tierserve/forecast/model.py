"""Seasonal models for hourly series, chosen by backtest against the seasonal-naive
baseline.

NOTE: choosing a model
    The last `holdout` hours (whole days) are held out. Each candidate is fitted to the
    hours before them, forecasts the held-out block in one go, and is scored by its MAPE
    over the held-out hours whose actual value is above zero (a percentage of zero is
    undefined, and a tier idle at night would otherwise score infinity). The best score
    wins, is refitted on the whole history and forecasts the horizon. Ties go to the
    earlier candidate, the baseline first: a model must beat it, not equal it.

      seasonal-naive  the same hour a week earlier (a day earlier with under a week of
                      history), repeated over the horizon
      hw-24           Holt-Winters (statsmodels ExponentialSmoothing), additive daily
                      season, no trend
      hw-24-damped    the same with an additive damped trend
      hw-24-log       hw-24 on log(1 + y): a season whose size follows the level, as a
                      weekend's smaller peak does
      hw-168          Holt-Winters with an additive weekly season (Monday is not Sunday)

    A Holt-Winters candidate needs two whole seasons to fit (48 hours; 336 for hw-168)
    before the held-out days; those that cannot be fitted are left out. A history too
    short for any of them falls back to the baseline (and says so); one under a day long
    to its mean. Forecasts are clipped at zero.
"""

import warnings
from dataclasses import dataclass, field

import numpy as np

BASELINE = "seasonal-naive"
# name -> (season length, trend, log) of the Holt-Winters candidates
HOLT_WINTERS = {"hw-24": (24, None, False), "hw-24-damped": (24, "add", False),
                "hw-24-log": (24, None, True), "hw-168": (168, None, False)}


@dataclass
class Choice:
    model: str
    """The candidate that forecast (BASELINE, a HOLT_WINTERS name, or `mean`)."""
    forecast: np.ndarray
    mape: float | None
    """The chosen model's backtest MAPE (a fraction; None: nothing to score)."""
    baseline_mape: float | None
    scores: dict[str, float | None] = field(default_factory=dict)
    """Every candidate's backtest MAPE."""
    note: str | None = None
    """Why the baseline was used without a contest (too little history)."""


def min_history(holdout: int) -> int:
    """Hours of history the smallest Holt-Winters contest needs."""
    return holdout + 2 * 24


def seasonal_naive(y: np.ndarray, horizon: int) -> np.ndarray:
    if len(y) < 24:
        return np.full(horizon, float(np.mean(y)) if len(y) else 0.0)
    period = 168 if len(y) >= 168 else 24
    last = y[-period:]
    return np.array([last[i % period] for i in range(horizon)], dtype=float)


def holt_winters(y: np.ndarray, horizon: int, period: int, trend: str | None,
                 log: bool) -> np.ndarray:
    from statsmodels.tsa.holtwinters import ExponentialSmoothing

    # Fitted on a unit scale: the optimiser converges several times faster on it.
    scale = max(float(np.mean(np.abs(y))), 1e-9)
    data = np.log1p(np.maximum(y, 0) / scale) if log else np.asarray(y, dtype=float) / scale
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # convergence chatter from the optimiser
        fit = ExponentialSmoothing(data, trend=trend, damped_trend=trend is not None,
                                   seasonal="add", seasonal_periods=period,
                                   initialization_method="estimated").fit(use_brute=False)
        out = np.asarray(fit.forecast(horizon), dtype=float)
    out = (np.expm1(out) if log else out) * scale
    if not np.all(np.isfinite(out)):
        raise ValueError("the fit diverged")
    return out


def predict(name: str, y: np.ndarray, horizon: int) -> np.ndarray:
    out = seasonal_naive(y, horizon) if name == BASELINE else \
        holt_winters(y, horizon, *HOLT_WINTERS[name])
    return np.maximum(out, 0.0)


def mape(actual: np.ndarray, predicted: np.ndarray) -> float | None:
    """Mean absolute percentage error over the hours with an actual value above zero."""
    mask = actual > 0
    if not mask.any():
        return None
    return float(np.mean(np.abs(predicted[mask] - actual[mask]) / actual[mask]))


def fits(name: str, train_hours: int) -> bool:
    if name == BASELINE:
        return train_hours >= 24
    return train_hours >= 2 * HOLT_WINTERS[name][0]


def choose(y: np.ndarray, horizon: int, holdout: int) -> Choice:
    """The forecast of the candidate that backtests best (see the module's note)."""
    y = np.asarray(y, dtype=float)
    train, actual = y[:-holdout], y[-holdout:]
    scores: dict[str, float | None] = {}
    for name in (BASELINE, *HOLT_WINTERS):
        if len(train) < 1 or not fits(name, len(train)):
            continue
        try:
            scores[name] = mape(actual, predict(name, train, holdout))
        except (ValueError, np.linalg.LinAlgError):
            continue  # a candidate that cannot fit this series is out of the contest
    baseline = scores.get(BASELINE)
    if len(y) < min_history(holdout):
        name = BASELINE if len(y) >= 24 else "mean"
        return Choice(name, predict(BASELINE, y, horizon), baseline, baseline, scores,
                      note=f"too little history: {len(y)} hours, the models need "
                           f"{min_history(holdout)} ({holdout // 24} held-out days and two "
                           f"to fit); forecasting with the seasonal-naive baseline")
    ranked = sorted(scores, key=lambda n: (scores[n] is None, scores[n] or 0.0))
    for name in ranked:  # refit the winner on everything; fall back if it cannot
        try:
            return Choice(name, predict(name, y, horizon), scores[name], baseline, scores)
        except (ValueError, np.linalg.LinAlgError):
            continue
    return Choice(BASELINE, predict(BASELINE, y, horizon), baseline, baseline, scores)
