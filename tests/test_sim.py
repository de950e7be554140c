"""The simulator: determinism, the same decisions as the engine, costs that add up."""

import math
from collections import Counter

import pytest

from conftest import get_engine
from tierserve.config import SchedulerConfig
from tierserve.core.clock import Clock
from tierserve.core.step_time import StepTimeModel
from tierserve.errors import ConfigError
from tierserve.model.shapes import preset
from tierserve.sampling_params import SamplingParams
from tierserve.sim.loop import Simulator
from tierserve.sim.report import summarize
from tierserve.hardware.roofline import load_hardware, roofline
from tierserve.sim.workload import SimRequest, make_workload

MODEL = StepTimeModel(fixed_s=0.010, per_seq_s=0.0002, per_token_s=0.0001, per_kv_token_s=1e-6)


def simulate(workload, policy="tiered", **kw):
    cfg = SchedulerConfig(max_num_seqs=kw.pop("max_num_seqs", 16),
                          max_num_batched_tokens=kw.pop("budget", 256), policy=policy)
    sim = Simulator(cfg, kw.pop("num_blocks", 4000), 16, 4096, MODEL, 3.6,
                    step_time_limit_s=kw.pop("limit", 0.05), **kw)
    return sim, sim.run(workload)


def test_same_seed_same_result_and_everything_finishes():
    spec = "poisson:rate=40,n=300,priority=0.2,flex=0.3,prompt=32-300,output=4-60,seed=3"
    a = summarize(simulate(make_workload(spec))[1], {"priority": (0.5, 0.05)})
    b = summarize(simulate(make_workload(spec))[1], {"priority": (0.5, 0.05)})
    assert a == b and a["requests"] == 300
    assert a["tiers"]["priority"]["tpot_p99_s"] <= 0.05 * 1.01  # the cap holds in the sim


def test_costs_add_up_to_the_machine_cost():
    sim, result = simulate(make_workload("gamma:rate=10,n=200,cv=3,prompt=16-200,seed=1"))
    m = result.meter
    attributed = sum(r.cost.machine_cost for r in result.requests)
    assert attributed + m.idle_cost + m.reserved_idle_cost == pytest.approx(m.machine_cost,
                                                                            rel=1e-9)
    assert m.machine_cost == pytest.approx(result.makespan_s * 3.6 / 3600, rel=1e-6)


def test_closed_loop_keeps_at_most_users_in_flight():
    sim, result = simulate(make_workload("closed:users=4,n=40,prompt=16-64,output=4-16"))
    assert len(result.requests) == 40
    events = sorted([(r.arrival_time, 1) for r in result.requests]
                    + [(r.finished_time, -1) for r in result.requests], key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    assert peak <= 4


def test_a_closed_loop_user_whose_request_is_refused_sends_the_next():
    """Flex requests refused for waiting too long (as the engine's 429) end their user's
    turn, as a finished request does: the user sends its next request at once (no think
    time), so all six users stay in flight to the end rather than leaving at a refusal."""
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=256, policy="tiered",
                          flex_max_wait_s=0.05)
    sim = Simulator(cfg, 4000, 16, 4096, MODEL, 3.6, step_time_limit_s=0.05)
    result = sim.run(make_workload("closed:users=6,n=80,flex=1,prompt=16-64,output=30-40,"
                                   "seed=2"))
    assert len(result.requests) == 80
    refused = [r for r in result.requests if r.finish_reason == "refused"]
    assert len(refused) > 6  # users came back after a refusal (each one at least once)
    last = sorted(result.requests, key=lambda r: r.arrival_time)[-20:]
    t = last[0].arrival_time  # a late instant: six users, six requests out
    assert sum(r.arrival_time <= t < r.finished_time for r in result.requests) == 6


def test_the_simulator_makes_the_engines_scheduling_decisions():
    """Same requests (lengths, tiers, all queued at once) through the real engine and the
    simulator: every step schedules the same requests for the same token counts."""
    engine = get_engine(max_num_seqs=4, max_num_batched_tokens=64,
                        enable_prefix_caching=False)
    lengths = [(30, 5), (70, 3), (12, 9), (100, 2), (45, 6), (8, 4)]
    order = {}
    for i, (p, o) in enumerate(lengths):
        rid = engine.add_request(None, [1000 + 37 * i + j for j in range(p)],
                                 SamplingParams(max_tokens=o, ignore_eos=True))
        order[rid] = i
    real = []
    original = engine.scheduler.schedule

    def spy(now=0.0):
        out = original(now)
        real.append([(order[s.request_id], len(s.token_ids)) for s in out.seqs])
        return out
    engine.scheduler.schedule = spy
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        del engine.scheduler.schedule
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, policy="tiered")
    sim = Simulator(cfg, 4000, 16, 4096, MODEL, 1.0, enable_prefix_caching=False)
    simulated = []
    original_sim = sim.scheduler.schedule

    def spy_sim(now=0.0):
        out = original_sim(now)
        simulated.append([(int(s.request_id[4:]), len(s.token_ids)) for s in out.seqs])
        return out
    sim.scheduler.schedule = spy_sim
    sim.run([SimRequest(0.0, "default", p, o) for p, o in lengths])
    assert simulated == [s for s in real if s]


def test_roofline_profiles_and_bad_specs():
    model = roofline(preset("llama-3-8b"), load_hardware("h100-sxm"))
    lone = model.predict_s([(1, 512)])
    batch = model.predict_s([(1, 512)] * 64)
    assert 0.004 < lone < 0.010 and batch < 3 * lone  # decode is memory-bound: batching pays
    with pytest.raises(ConfigError, match="unknown hardware 'tpu'"):
        load_hardware("tpu")
    with pytest.raises(ConfigError, match="unknown workload kind"):
        make_workload("uniform:n=3")
    with pytest.raises(ConfigError, match="cannot read the trace"):
        make_workload("trace:/nonexistent.csv")


def test_a_sequence_dearer_than_the_guard_s_cap_idles_until_it_runs_out_as_the_engine_would():
    """With a sequence dearer than any cap allows (its own cost over the guard's floor of
    two fixed step times) only priority runs; once the last priority request left, others
    wait out priority_guard_s (10 s) instead of stalling the run."""
    model = StepTimeModel(fixed_s=0.010, per_seq_s=0.05, per_token_s=0.0001,
                          per_kv_token_s=1e-6)
    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256)
    sim = Simulator(cfg, 4000, 16, 4096, model, 3.6, step_time_limit_s=0.005)
    result = sim.run([SimRequest(0.0, "priority", 50, 5), SimRequest(0.001, "default", 50, 5)])
    by_tier = {r.tier.label: r for r in result.requests}
    assert by_tier["default"].finish_reason == "length"
    assert by_tier["default"].first_scheduled_time > by_tier["priority"].finished_time + 10


def _trace(seed: int = 34) -> list[SimRequest]:
    """Arrivals over 0.4 s in three tiers; two default tenants of weight 3 and 1 arrive in
    bursts (their fair shares decide the order); half the prompts share a 48-token
    prefix (three KV blocks: prefix-cache hits on both sides)."""
    import random
    rng = random.Random(seed)
    shared = tuple(2000 + j for j in range(48))
    out, t = [], 0.0
    for i in range(28):
        t += rng.expovariate(70.0)
        tier = rng.choice(["priority", "default", "default", "default", "flex"])
        tenant = rng.choice(["heavy", "light"]) if tier == "default" else ""
        n = rng.randint(20, 140)
        own = tuple(5000 + 300 * i + j for j in range(n))
        prompt = (shared + own) if rng.random() < 0.5 else own
        out.append(SimRequest(round(t, 4), tier, len(prompt), rng.randint(3, 24),
                              prompt_ids=prompt, tenant=tenant,
                              weight=3.0 if tenant == "heavy" else 1.0))
    return out


def test_the_twin_makes_the_engines_decisions_under_both_caps_with_tenants(tmp_path):
    """A trace of arrivals over time through the real engine and through the simulator,
    with the tiered policy's priority cap and decode cap on, two tenants sharing the
    default tier by weight, a flex wait short enough to refuse some, and prefix caching.
    The engine's clock moves by the step-time model's prediction for each step it runs
    (so what it measures is what the twin predicts): then every step schedules the same
    requests for the same token counts, and every request gets its first token and ends
    at the same instants, in the same way (served tier, reason, cached tokens)."""
    from tierserve.core.clock import ManualClock
    from tierserve.core.request import Owner

    model = StepTimeModel(fixed_s=0.010, per_seq_s=0.0002, per_token_s=0.0002,
                          per_kv_token_s=1e-6)
    profile = tmp_path / "profile.json"
    model.save(profile)
    limit = 0.016  # the priority cap: ~30 prompt tokens beside a decode; the decode cap 2.5x
    engine = get_engine(max_num_seqs=6, max_num_batched_tokens=256, flex_max_wait_s=0.15,
                        priority_step_time_s=limit, step_time_profile=str(profile))
    assert engine.scheduler.decode_time_limit_s == pytest.approx(2.5 * limit)
    trace = _trace()
    clock, real_steps, stats = ManualClock(), [], {}
    execute, engine.clock = engine.runner.execute, clock

    def timed(out):  # the model runs; time passes as the twin would predict
        result = execute(out)
        real_steps.append([(int(s.request_id[4:]), len(s.token_ids)) for s in out.seqs])
        seqs = [(len(s.token_ids), s.start_pos + len(s.token_ids)) for s in out.seqs]
        clock.advance(out.predicted_s if out.predicted_s is not None else model.predict_s(seqs))
        return result
    engine.runner.execute = timed
    try:
        waiting = list(enumerate(trace))
        while waiting or engine.has_unfinished_requests():
            if not engine.has_unfinished_requests() and waiting[0][1].arrival_s > clock.now():
                clock.set(waiting[0][1].arrival_s)  # idle until the next arrival
            while waiting and waiting[0][1].arrival_s <= clock.now():
                i, r = waiting.pop(0)
                engine.add_request(f"sim-{i}", list(r.prompt_ids), SamplingParams(
                    max_tokens=r.output_tokens, ignore_eos=True, temperature=0),
                    arrival_time=r.arrival_s, tier=r.tier,
                    owner=Owner(r.tenant, r.weight) if r.tenant else None)
            steps_before = len(real_steps)
            for out in engine.step():
                if out.finished:
                    stats[out.request_id] = out.metrics
            if len(real_steps) == steps_before and engine.has_unfinished_requests():
                # nothing ran: as the twin, wait for the next arrival (or the guard)
                clock.set(waiting[0][1].arrival_s if waiting else
                          clock.now() + engine.scheduler.config.priority_guard_s + 1e-6)
    finally:
        del engine.runner.execute
        engine.clock = Clock()
    cfg = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=256, flex_max_wait_s=0.15)
    sim = Simulator(cfg, engine.block_manager.num_blocks, engine.block_manager.block_size,
                    engine.max_model_len, model, 3.6, step_time_limit_s=limit)
    simulated = []
    original = sim.scheduler.schedule

    def spy(now=0.0):
        out = original(now)
        if out.seqs:
            simulated.append([(int(s.request_id[4:]), len(s.token_ids)) for s in out.seqs])
        return out
    sim.scheduler.schedule = spy
    result = sim.run(trace)
    assert simulated == real_steps
    twin = {r.request_id: r for r in result.requests}
    assert twin.keys() == stats.keys() and len(twin) == len(trace)

    def fate(r):
        return (r.billed_tier.label, r.finish_reason, r.num_output_tokens, r.num_cached_tokens,
                r.num_preemptions, r.first_token_time, r.finished_time)
    assert {k: fate(r) for k, r in twin.items()} == {k: fate(r) for k, r in stats.items()}
    reasons = Counter(r.finish_reason for r in twin.values())
    assert reasons["refused"] > 0 and reasons["length"] > 0  # the trace exercises both
    assert any(r.num_cached_tokens for r in twin.values())


def test_sim_accuracy_sorts_steps_by_kind_and_reports_the_models_error_per_kind():
    from tierserve.bench.sim_accuracy import step_kind, step_residuals

    assert step_kind([(1, 40)]) == "decode x1"
    assert step_kind([(1, 40)] * 3) == "decode x2-4"
    assert step_kind([(64, 64)]) == "prefill"
    assert step_kind([(64, 64)] + [(1, 9)] * 20) == "mixed x17-64"
    model = StepTimeModel(0.01, 0.0, 0.001)
    # decodes alone take what the model says; mixed steps twice that
    steps = [([(1, 10)], model.predict_s([(1, 10)]))] * 3
    steps += [([(32, 32), (1, 10)], 2 * model.predict_s([(32, 32), (1, 10)]))]
    line = step_residuals(model, steps)
    assert "decode x1 n=3" in line and "measured/predicted=1.00 (median 1.00)" in line
    assert "mixed x1 n=1" in line and "measured/predicted=2.00 (median 2.00)" in line


def test_a_runs_step_drift_is_the_mean_of_its_steps_over_the_model():
    """How far a run's steps moved from the model (plan_check, sim-accuracy, fleet_twin):
    the mean ratio, the statistic a whole-step model is centred on, so right-skewed steps
    read 1.0 against a model centred on them (their median would read under it) and 10%
    slower steps 1.1; NaN with nothing to read."""
    from tierserve.bench.tiers import step_drift

    model = StepTimeModel(0.01, 0.0, 0.001)
    lone = model.predict_s([(1, 10)])
    steps = [([(1, 10)], 1.1 * lone)] * 3 + [([(1, 10)], 3.5 * lone)]
    assert step_drift(model, steps) == pytest.approx(1.7)
    assert step_drift(model.scaled(2), steps) == pytest.approx(0.85)
    centred = model.centred(steps)
    assert step_drift(centred, steps) == pytest.approx(1.0)
    assert step_drift(centred, [(seqs, 1.1 * t) for seqs, t in steps]) == pytest.approx(1.1)
    assert math.isnan(step_drift(model, []))
    assert math.isnan(step_drift(StepTimeModel(0.0, 0.0, 0.0), steps))   # nothing predicted


def test_sim_accuracy_rounds_compare_cell_by_cell_medians():
    """--repeats: the twin's and the engine's medians over rounds, cell by cell; a tier
    one round lacks, or a cell it has no value for, does not pull the median."""
    from tierserve.bench.sim_accuracy import CELLS, _cellwise_median, _compare

    def fig(tok_s, ttft, tpot, flex=True):
        cells = {k: (ttft if k.startswith("ttft") else tpot) for k in CELLS}
        out = {"tok_s": tok_s, "priority": {**cells, "attainment": 1.0,
                                            "attainment_slow": 1.0, "attainment_fast": 1.0}}
        if flex:
            out["flex"] = {**{k: 2 * ttft for k in CELLS}, "tpot_p50": None,
                           "attainment": 0.5, "attainment_slow": 0.5,
                           "attainment_fast": 0.5}
        return out

    engines = _cellwise_median([fig(10, 0.1, 0.03), fig(30, 0.3, 0.01),
                                fig(20, 0.2, 0.02, flex=False)])
    assert engines["tok_s"] == 20
    assert engines["priority"]["ttft_p50"] == 0.2 and engines["priority"]["tpot_p99"] == 0.02
    assert engines["flex"]["ttft_p90"] == pytest.approx(0.4)  # median of the two rounds with flex
    assert engines["flex"]["tpot_p50"] is None and engines["flex"]["attainment"] == 0.5
    twins = _cellwise_median([fig(22, 0.21, 0.02), fig(18, 0.19, 0.03), fig(40, 0.5, 0.02)])
    errors = {"headline": [], "points": []}
    line = _compare(engines, twins, errors)
    assert "tok/s 20.0/22.0 (10%)" in line
    assert "flex: ttft_p50 400/420ms (5%)" in line and "tpot_p50 -/-ms" in line
    # priority's TTFT p50, p90 and TPOT p50, then flex's (its TPOT: no value, left out)
    assert errors["headline"][:3] == pytest.approx([0.05, 0.05, 0.0])
    assert errors["headline"][3:5] == pytest.approx([0.05, 0.05])
    assert errors["points"] == [0.0, 0.0]


def test_a_plan_with_a_step_time_margin_assumes_slower_steps_and_refuses_a_bad_margin():
    """plan --step-time-margin: the twin's steps take that much longer while its
    scheduler plans with the model as calibrated; a negative margin is refused by name."""
    from tierserve.sim.plan import Cell, Planner
    from tierserve.sim.workload import make_workload

    from tierserve.core.step_time import FEATURES
    from tierserve.sim.fleet import FleetConfig, make_simulator

    model = StepTimeModel(0.01, 0.001, 0.0002, 3e-6, 4e-9, 0.003)
    slowed = model.scaled(1.5)
    for f in FEATURES:
        assert getattr(slowed, f) == pytest.approx(1.5 * getattr(model, f)) != 0
    slo = {"priority": (1.0, 0.1), "default": (4.0, 0.2)}
    workload = make_workload("poisson:rate=4,n=60,priority=0.3")
    cell = Cell("h100-sxm", "shared", 16, 512)
    shape = preset("llama-3-8b")
    plain = Planner(shape, slo).simulate(cell, 1, workload, slo)
    slow = Planner(shape, slo, step_time_margin=0.5).simulate(cell, 1, workload, slo)
    assert slow["makespan_s"] > plain["makespan_s"]
    for tier in slo:
        assert slow["tiers"][tier]["tpot_p50_s"] > 1.3 * plain["tiers"][tier]["tpot_p50_s"]
    # the replicas plan with the model as calibrated, and their caps learn the ratio
    machine = Planner(shape, slo).machine("h100-sxm")
    sim = make_simulator(machine, SchedulerConfig(max_num_seqs=16), FleetConfig(), 0.05,
                         step_time_margin=0.5)
    sim.run(workload[:20])
    replica = sim.replicas[0]
    assert replica.scheduler.step_time_model is machine.model
    assert replica.scheduler.step_time_ratio == pytest.approx(1.5, rel=0.05)
    with pytest.raises(ConfigError, match="--step-time-margin"):
        Planner(shape, slo, step_time_margin=-0.1)


def test_a_replicas_way_in_lengthens_ttft_and_end_to_end_by_itself_not_tpot(tmp_path):
    """What a request spends outside a replica's steps (a profile's way_in_s, measured by
    `calibrate --backend --from-steps`, or `sim --way-in-s`) comes before its first step:
    alone on the replica its TTFT and end-to-end grow by exactly that, its TPOT and the
    steps not, on one engine and behind the gateway; a profile's way_in_s is read back, an
    explicit one wins, and a negative or non-number one is refused by name."""
    import json
    import subprocess
    import sys
    from dataclasses import asdict

    from tierserve.sim.fleet import FleetConfig, machine_for, make_simulator

    lone = [SimRequest(0.0, "default", 100, 10), SimRequest(5.0, "priority", 50, 10),
            SimRequest(9.0, "flex", 80, 6)]
    _, plain = simulate(lone)
    _, late = simulate(lone, way_in_s=0.02)
    assert late.num_steps == plain.num_steps
    for a, b in zip(plain.requests, late.requests):
        assert b.ttft_s == pytest.approx(a.ttft_s + 0.02)
        assert b.tpot_s == pytest.approx(a.tpot_s)
        assert b.finished_time == pytest.approx(a.finished_time + 0.02)
    profile = tmp_path / "p.json"
    MODEL.save(profile, way_in_s=0.015)
    shape = preset("smollm2-135m")
    assert machine_for(shape, step_time_profile=str(profile)).way_in_s == 0.015
    assert machine_for(shape, step_time_profile=str(profile), way_in_s=0).way_in_s == 0
    assert machine_for(shape, "h100-sxm", way_in_s=0.01).way_in_s == 0.01

    def gateway_run(way_in_s):
        machine = machine_for(shape, step_time_profile=str(profile), way_in_s=way_in_s)
        sim = make_simulator(machine, SchedulerConfig(max_num_seqs=8), FleetConfig(
            replicas=2, router="gateway"), 0.05)
        return sim.run(lone)
    fleet, fleet_late = gateway_run(0), gateway_run(None)
    for a, b in zip(fleet.requests, fleet_late.requests):
        assert b.ttft_s == pytest.approx(a.ttft_s + 0.015)
        assert b.tpot_s == pytest.approx(a.tpot_s)
    for bad in (-0.01, "fast", True, float("inf")):
        profile.write_text(json.dumps({"step_time_model": asdict(MODEL), "way_in_s": bad}))
        with pytest.raises(ConfigError, match="way_in_s must be a finite number of seconds >= 0"):
            machine_for(shape, step_time_profile=str(profile))
    for bad in (-1, float("inf")):
        with pytest.raises(ConfigError, match="--way-in-s must be a finite number"):
            machine_for(shape, "h100-sxm", way_in_s=bad)
    out = subprocess.run([sys.executable, "-m", "tierserve.cli", "sim", "--workload",
                          "poisson:rate=1,n=5", "--way-in-s", "-0.5"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "--way-in-s must be a finite number" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    # a request on its way counts for the least-tokens router at once: a burst of two
    # goes one to each replica, not both to the first while neither has arrived
    MODEL.save(tmp_path / "q.json")
    machine = machine_for(shape, step_time_profile=str(tmp_path / "q.json"), way_in_s=0.05)
    sim = make_simulator(machine, SchedulerConfig(max_num_seqs=8), FleetConfig(
        replicas=2, router="least-tokens"), 0.05)
    result = sim.run([SimRequest(0.0, "default", 100, 10), SimRequest(0.0, "default", 100, 10)])
    assert [len(r.request_ids) for r in result.replicas] == [1, 1]
    assert len(result.requests) == 2


def test_sim_accuracy_says_how_far_five_percent_moves_the_engines_attainment():
    """Attainment points apart read beside the engine's own attainment with every time 5%
    longer and shorter: where an SLO sits among the tier's times, a twin 5% off cannot
    come within 5 points, and the line says so."""
    from tierserve.bench.sim_accuracy import _compare, figures

    rows = [{"tier": "priority", "ttft_s": 0.1, "tpot_s": t, "output_tokens": 10}
            for t in (0.048, 0.049, 0.051, 0.06)]
    real = figures(rows, 1.0, {"priority": (0.5, 0.05)})["priority"]
    assert (real["attainment"], real["attainment_slow"], real["attainment_fast"]) == (
        0.5, 0.0, 0.75)
    twin = figures([{**r, "tpot_s": r["tpot_s"] * 1.03} for r in rows], 1.0,
                   {"priority": (0.5, 0.05)})
    errors = {"points": [], "edge": []}
    line = _compare({"tok_s": 40.0, "priority": real}, twin, errors)
    assert "attainment 50%/25% (the engine's with times 5% longer / shorter: 0% / 75%)" in line
    assert errors["points"] == [25.0] and errors["edge"] == [50.0]
