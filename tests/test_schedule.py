"""Schedules (schedule.py, sim/hourly.py, sim/replay.py): the YAML format round trip,
pre-warm leads, `plan --forecast`, and a schedule replayed on a diurnal week costing less
than the static fleet sized for the peak."""

import json

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from tierserve.cli import main
from tierserve.core.step_time import StepTimeModel
from tierserve.core.tier_rules import SLO_CAP_SHARE
from tierserve.errors import ConfigError
from tierserve.model.shapes import preset
from tierserve.sim.fleet import Machine
from tierserve.sim.hourly import (
    HourlyPlanner,
    HourTraffic,
    forecast_error,
    lead_hours,
    parse_duration,
    prewarmed,
    traffic_from_forecast,
)
from tierserve.sim.plan import Cell, Planner
from tierserve.sim.replay import Replay, compare
from tierserve.schedule import HourPlan, Schedule, load_schedule, parse_schedule, \
    save_schedule
from tierserve.sim.weekly import WeeklyProfile, parse_weekly

SLO = {"priority": (0.5, 0.05), "default": (2.0, 0.1)}


def hour(replicas=1, need=None, batch=False, **kw) -> HourPlan:
    return HourPlan({"main": replicas}, {"main": need or replicas}, batch=batch, **kw)


def test_schedule_round_trip_and_lookups(tmp_path):
    s = Schedule(1_000_000 * 3600.0, [hour(1, batch=True), hour(3, 2), hour(2)],
                 prewarm_s=1800, slo=SLO, attainment=0.95)
    path = tmp_path / "schedule.yaml"
    save_schedule(s, path)
    back = load_schedule(path)
    assert back == s
    assert yaml.safe_load(path.read_text())["schedule"]["hours"][1]["replicas"] == {"main": 3}
    t0 = s.start_unix
    assert s.entry_at(t0 + 3600 * 1.5).need == {"main": 2}
    assert s.index_at(t0 + 3600 * 4) == 1 and s.index_at(t0 - 1) == 2  # repeats both ways
    assert s.next_change(t0 + 10) == t0 + 3600
    assert s.next_batch_start(t0 + 3600 * 1.2) == t0 + 3600 * 3
    assert s.next_batch_start(t0 + 5) == t0 + 5
    # the mapping under `schedule:` parses as well as the whole file
    assert parse_schedule(s.to_dict()["schedule"]) == s


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(colour="red"), "unknown key"),
    (lambda d: d["hours"][0].update(replicas={"fast": 1}), "pools"),
    (lambda d: d["hours"][0].update(reserved_priority_seqs=256), "reserved_priority_seqs"),
    (lambda d: d["hours"][0].update(hour=5), "in order"),
    (lambda d: d["hours"][0].update(batch="yes"), "true or false"),
    (lambda d: d.update(hours=[]), "no hours"),
    (lambda d: d.update(version=2), "version"),
])
def test_schedule_errors(edit, message):
    raw = Schedule(0.0, [hour(2)], slo=SLO).to_dict()["schedule"]
    edit(raw)
    with pytest.raises(ConfigError, match=message):
        parse_schedule(raw)


@given(st.lists(st.integers(0, 20), min_size=1, max_size=72), st.integers(0, 5))
def test_prewarm_never_below_need_and_leads_honoured(needs, lead):
    ready = prewarmed(needs, lead)
    n = len(needs)
    for h in range(n):
        assert ready[h] >= needs[h]
        # capacity for each of the next `lead` hours is already up in hour h ...
        assert all(ready[h] >= needs[(h + j) % n] for j in range(lead + 1))
        # ... and nothing more than that is kept
        assert ready[h] == max(needs[(h + j) % n] for j in range(lead + 1))


def test_lead_hours_and_durations():
    assert [lead_hours(parse_duration(t)) for t in ("0", "30m", "1h", "90m", "3600s")] == \
        [0, 1, 1, 2, 1]
    with pytest.raises(ConfigError):
        parse_duration("soon")


def forecast_doc(profile: WeeklyProfile, hours: int, batch_per_day: float = 0.0) -> dict:
    """A forecast file of the profile's mean rates (what a perfect forecaster says)."""
    prompt, output = profile.mean_tokens()
    tiers = {}
    for tier, share in (("priority", profile.priority), ("default", 1 - profile.priority)):
        n = [profile.mean_rate(h) * 3600 * share for h in range(hours)]
        tiers[tier] = {"requests": n, "prompt_tokens": [x * prompt for x in n],
                       "output_tokens": [x * output for x in n], "models": {}}
    if batch_per_day:
        b = [batch_per_day / 8 if 9 <= h % 24 < 17 else 0.0 for h in range(hours)]
        tiers["batch"] = {"requests": b, "prompt_tokens": [x * prompt for x in b],
                          "output_tokens": [x * output for x in b], "models": {}}
    return {"version": 1, "start": "1970-01-05T00:00:00+00:00", "start_unix": 4 * 86400.0,
            "hour_s": 3600, "horizon_hours": hours, "source": "test", "history": {},
            "holdout_hours": 48, "note": None, "tiers": tiers}


def test_plan_forecast_writes_a_schedule_the_loader_reads(tmp_path, capsys):
    profile = WeeklyProfile(peak=150, swing=6)
    path, out = tmp_path / "forecast.json", tmp_path / "schedule.yaml"
    path.write_text(json.dumps(forecast_doc(profile, 24, batch_per_day=20_000)))
    assert main(["plan", "--forecast", str(path), "--slo", "priority=0.5,0.05", "--slo",
                 "default=2,0.1", "--window-s", "2", "--prewarm", "30m", "--out",
                 str(out)]) == 0
    text = capsys.readouterr().out
    assert "replica-hours" in text
    s = load_schedule(out)
    assert len(s.hours) == 24 and s.prewarm_s == 1800 and s.hardware == "h100-sxm"
    assert s.slo == {"priority": (0.5, 0.05), "default": (2.0, 0.1)}
    needs = [h.need["main"] for h in s.hours]
    assert [h.replicas["main"] for h in s.hours] == prewarmed(needs, 1)
    assert max(needs) > min(needs)  # the day's peak needs more than its night
    assert any(h.batch for h in s.hours) and not s.hours[10].batch  # batch in the troughs
    assert all(h.batch_rate > 0 for h in s.hours if h.batch)
    cap = SLO_CAP_SHARE * 0.05  # the priority TPOT target sets the cap, as in the engine
    assert all(h.priority_step_time_s == pytest.approx(cap) for h in s.hours)
    # and `sim --schedule` replays it beside the static fleets
    assert main(["sim", "--schedule", str(out), "--workload", "weekly:peak=40,swing=6,"
                 "batch=2000,noise=0,days=1", "--window-s", "1"]) == 0
    text = capsys.readouterr().out
    assert "schedule vs static peak" in text and "static mean" in text


# A slow machine (about 12 short requests/s a replica): each simulated window is cheap.
SLOW = Machine("slow", StepTimeModel(fixed_s=0.05, per_seq_s=0.001, per_token_s=0.0005,
                                     per_kv_token_s=1e-6), 4000, 16, 4096, 3.6)
SLOW_SLO = {"priority": (1.0, 0.15), "default": (3.0, 0.3)}


def test_schedule_on_a_diurnal_week_costs_less_than_the_peak_fleet():
    profile = parse_weekly("weekly:peak=30,swing=6,weekend=0.5,noise=0.05,batch=20000,"
                           "prompt=32-64,output=8-32,days=2,seed=3")
    planner = Planner(preset("llama-3-8b"), SLOW_SLO, 0.9)
    planner._machines["slow"] = SLOW  # the planner's machine cache: no roofline for it
    hourly = HourlyPlanner(planner, [Cell("slow", "shared", 64, 512)], 8, window_s=10.0)
    traffic = [HourTraffic(profile.mean_rate(h), (("priority", 0.2), ("default", 0.8)),
                           *profile.mean_tokens(), profile.batch_lines(h),
                           *profile.mean_tokens())
               for h in range(24)]
    schedule = hourly.plan(traffic, 1800, 0.15, 0.0)
    assert max(h.total_replicas for h in schedule.hours) > 1
    replay = Replay(profile, SLOW, SLOW_SLO, window_s=10.0)
    s, peak, mean = compare(schedule, profile, replay, hourly)
    assert s.cost < peak.cost and peak.replica_hours == 48 * int(peak.name.split("x")[-1])
    for tier in ("priority", "default"):
        assert s.attainment(tier) >= 0.9
    assert mean.cost < peak.cost and mean.attainment("default") < s.attainment("default")
    assert s.batch_lines == 40_000 and s.batch_late == 0
    assert s.batch_on_time == pytest.approx(s.batch_lines)  # every line inside its window
    assert s.batch_in_batch_hours == pytest.approx(s.batch_on_time)  # all in the troughs


def test_weekly_profile_shape_and_spec():
    p = parse_weekly("weekly:peak=100,swing=4,weekend=0.5,noise=0,prompt=10-20,days=3")
    assert p.mean_rate(10) == pytest.approx(100 * p.shape(10.5))
    assert p.mean_rate(3) < p.mean_rate(10)
    assert p.mean_rate(24 * 5 + 10) == pytest.approx(0.5 * p.mean_rate(10))  # Saturday
    assert p.rate(7) == p.mean_rate(7) and p.hours == 72 and p.prompt == (10, 20)
    w = p.draw(50, 4.0, batch_rate=5, seed=1)
    assert w == p.draw(50, 4.0, batch_rate=5, seed=1)
    assert 150 < sum(r.tier != "batch" for r in w) < 250
    assert all(10 <= r.prompt_tokens <= 20 for r in w)
    with pytest.raises(ConfigError, match="unknown key"):
        parse_weekly("weekly:peek=3")


def test_headroom_raises_the_rate_not_the_mix():
    doc = forecast_doc(WeeklyProfile(peak=100), 24)
    doc["tiers"]["default"]["models"] = {"requests": {"mape": 0.2}}
    doc["tiers"]["priority"]["models"] = {"requests": {"mape": 0.1}}
    assert forecast_error(doc) == pytest.approx(0.18)
    plain, raised = traffic_from_forecast(doc), traffic_from_forecast(doc, 0.1)
    for a, b in zip(plain, raised):
        assert b.rate == pytest.approx(1.1 * a.rate) and b.shares == a.shares
        assert (b.prompt, b.output) == (a.prompt, a.output)
    assert dict(plain[10].shares)["priority"] == pytest.approx(0.2)
