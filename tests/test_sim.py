"""The simulator: determinism, the same decisions as the engine, costs that add up."""

import pytest

from conftest import get_engine
from tierserve.config import SchedulerConfig
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


def test_a_cap_below_one_step_idles_until_the_guard_runs_out_as_the_engine_would():
    """With the cap under the step's fixed time only priority runs; once the last priority
    request left, others wait out priority_guard_s (10 s) instead of stalling the run."""
    sim, result = simulate([SimRequest(0.0, "priority", 50, 5),
                            SimRequest(0.001, "default", 50, 5)], limit=0.005)
    by_tier = {r.tier.label: r for r in result.requests}
    assert by_tier["default"].finish_reason == "length"
    assert by_tier["default"].first_scheduled_time > by_tier["priority"].finished_time + 10
