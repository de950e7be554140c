"""Fleets, routers, the new workloads, fast-vs-batch and the planner (sim/fleet.py,
sim/plan.py): small workloads on a fake step-time model or the datasheet rooflines."""

import json
import re

import pytest

from tierserve.cli import main
from tierserve.config import SchedulerConfig
from tierserve.core.request import Request
from tierserve.core.step_time import StepTimeModel
from tierserve.errors import ConfigError
from tierserve.metering.ledger import Ledger, RequestRow
from tierserve.model.shapes import preset
from tierserve.sim.fleet import FleetConfig, Machine, Router, make_simulator
from tierserve.sim.loop import Replica
from tierserve.sim.plan import Planner, describe_headroom
from tierserve.sim.report import fast_vs_batch, summarize
from tierserve.sim.workload import SimRequest, make_workload, with_priority_fraction

MODEL = StepTimeModel(fixed_s=0.010, per_seq_s=0.0002, per_token_s=0.0001, per_kv_token_s=1e-6)
MACHINE = Machine("test", MODEL, 4000, 16, 4096, 3.6)


def fleet(workload, replicas=2, router="least-tokens", deployment="shared", max_num_seqs=16,
          budget=256, limit=0.05):
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    sim = make_simulator(MACHINE, config, FleetConfig(replicas, router, deployment), limit)
    return sim.run(workload)


def test_round_robin_alternates():
    result = fleet([SimRequest(0.01 * i, "default", 100, 10) for i in range(6)],
                   router="round-robin")
    assert [p.request_ids for p in result.replicas] == [["sim-0", "sim-2", "sim-4"],
                                                        ["sim-1", "sim-3", "sim-5"]]


def test_least_tokens_sends_to_the_emptier_replica():
    replicas = [Replica(SchedulerConfig(), 4000, 16, 4096, MODEL, 1.0, name=f"r{i}")
                for i in range(2)]
    route = Router("least-tokens")
    assert route("default", replicas) == 0  # a tie goes to the lowest index
    replicas[0].add(Request("big", [5] * 2000, 500))
    assert replicas[0].outstanding_tokens == 2500
    assert route("default", replicas) == 1
    # In a run: a long request first, then short ones, which all avoid its replica.
    result = fleet([SimRequest(0.0, "default", 3000, 400)]
                   + [SimRequest(0.001 * (i + 1), "default", 50, 5) for i in range(3)])
    assert [p.request_ids for p in result.replicas] == [["sim-0"],
                                                        ["sim-1", "sim-2", "sim-3"]]


def test_two_replicas_cut_ttft_and_cost_the_sum_of_both():
    workload = make_workload("poisson:rate=30,n=200,priority=0,prompt=64-256,output=16-64,"
                             "seed=2")
    one = summarize(fleet(workload, replicas=1))
    result = fleet(workload, replicas=2)
    two = summarize(result)
    assert one["utilization"] > 0.95  # one replica is saturated
    assert two["tiers"]["default"]["ttft_p50_s"] < 0.5 * one["tiers"]["default"]["ttft_p50_s"]
    parts = [p.meter.machine_cost for p in result.replicas]
    assert result.meter.machine_cost == pytest.approx(sum(parts), rel=1e-12)
    assert parts[0] == pytest.approx(result.makespan_s * 3.6 / 3600, rel=1e-6)
    assert len(two["replicas"]) == 2 and two["requests"] == 200
    attributed = sum(r.cost.machine_cost for r in result.requests)
    m = result.meter
    assert attributed + m.idle_cost + m.reserved_idle_cost == pytest.approx(m.machine_cost)


def test_dedicated_deployment_serves_priority_on_its_own_replica():
    workload = make_workload("poisson:rate=20,n=120,priority=0.3,flex=0.2,prompt=32-128,"
                             "output=4-32,seed=4")
    result = fleet(workload, replicas=3, deployment="dedicated")
    fast, *main_ = result.replicas
    tier_of = {r.request_id: r.tier.label for r in result.requests}
    assert fast.name == "fast0" and fast.request_ids
    assert all(tier_of[rid] == "priority" for rid in fast.request_ids)
    assert all(tier_of[rid] != "priority" for p in main_ for rid in p.request_ids)
    assert fast.meter.idle_cost == 0 and fast.meter.reserved_idle_cost > 0
    with pytest.raises(ConfigError, match="dedicated replicas < replicas"):
        fleet(workload, replicas=1, deployment="dedicated")


def test_diurnal_arrivals_bunch_near_the_peak():
    reqs = make_workload("diurnal:rate=0.5,peak=5,period=100,n=1000,seed=1")
    phase = [r.arrival_s % 100 for r in reqs]
    near_peak = sum(25 <= p < 75 for p in phase)
    assert near_peak > 0.7 * len(reqs)  # the peak half holds most (about 82% expected)
    assert reqs == make_workload("diurnal:rate=0.5,peak=5,period=100,n=1000,seed=1")
    assert all(a.arrival_s < b.arrival_s for a, b in zip(reqs, reqs[1:]))


def test_ledger_replay_reads_what_the_ledger_wrote(tmp_path):
    path = tmp_path / "ledger.db"
    ledger = Ledger(path, commit_interval_s=0.01)
    # (finish time, e2e, tier served, prompt, output): arrivals 100, 100.5, 108
    for i, (t, e2e, tier, p, o) in enumerate([(105.0, 5.0, "default", 300, 40),
                                              (101.0, 0.5, "priority", 20, 8),
                                              (110.0, 2.0, "flex", 64, 0)]):
        ledger.record(RequestRow(t, f"r{i}", "acme", "m", tier, tier, p, 0, o, 0.1, 0.1, 0.1,
                                 0.0, 0.0, 0.0, "refused" if o == 0 else "length", e2e_s=e2e))
    ledger.close()
    reqs = make_workload(f"ledger:{path}")
    assert [(r.arrival_s, r.tier, r.prompt_tokens, r.output_tokens) for r in reqs] == [
        (0.0, "default", 300, 40), (0.5, "priority", 20, 8), (8.0, "flex", 64, 1)]
    assert [r.arrival_s for r in make_workload(f"ledger:{path},speed=2,n=2")] == [0.0, 0.25]
    with pytest.raises(ConfigError, match="cannot read the ledger"):
        make_workload(f"ledger:{tmp_path / 'missing.db'}")


def test_fast_vs_batch_cost_falls_with_batch_size():
    report = fast_vs_batch(MACHINE, [1, 4, 16], prompt_tokens=64, output_tokens=16,
                           max_num_batched_tokens=256)
    rows = report["rows"]
    costs = [r["cost_per_1m_output"] for r in rows]
    assert costs[0] > costs[1] > costs[2]
    assert rows[0]["exclusive_over_batched"] == 1.0
    assert rows[2]["exclusive_over_batched"] == pytest.approx(costs[0] / costs[2])
    assert rows[2]["throughput_tok_s"] > 4 * rows[0]["throughput_tok_s"]


def test_priority_fraction_moves_only_the_drawn_requests():
    reqs = make_workload("poisson:rate=5,n=400,priority=0.2,flex=0.3,seed=1")
    moved = with_priority_fraction(reqs, 0.5, seed=3)
    assert 0.4 < sum(r.tier == "priority" for r in moved) / 400 < 0.6
    assert all(m.tier in ("priority", r.tier if r.tier != "priority" else "default")
               and m.arrival_s == r.arrival_s for r, m in zip(reqs, moved))
    assert {r.tier for r in with_priority_fraction(reqs, 0.0)} == {"default", "flex"}


PLAN_WORKLOAD = "poisson:rate=40,n=80,priority=0.2,prompt=64-256,output=8-32,seed=1"
PLAN_SLO = {"priority": (0.2, 0.05), "default": (1.0, 0.1)}


def test_plan_finds_cheapest_configurations_that_meet_the_slos():
    planner = Planner(preset("llama-3-8b"), PLAN_SLO, attainment=0.9)
    workload = make_workload(PLAN_WORKLOAD)
    fits = planner.search(workload, ["l4", "a100-80gb", "h100-sxm"], ["shared", "dedicated"],
                          [4, 16], [2048], max_replicas=3)
    assert len(fits) >= 3 and all(fits[0].cost_per_hour <= f.cost_per_hour for f in fits)
    assert {f.replicas for f in fits} >= {1, 2}
    for fit in fits:
        summary = planner.simulate(fit.cell, fit.replicas, workload, PLAN_SLO)
        assert all(summary["tiers"][t]["slo_attainment"] >= 0.9 for t in PLAN_SLO)
        if fit.replicas > (2 if fit.cell.deployment == "dedicated" else 1):  # the fewest
            fewer = planner.simulate(fit.cell, fit.replicas - 1, workload, PLAN_SLO)
            assert min(fewer["tiers"][t]["slo_attainment"] for t in PLAN_SLO) < 0.9
    curve = planner.fast_mode_curve(fits[0], workload, [0.0, 1.0], [1.0], max_replicas=3)
    assert [p["priority_fraction"] for p in curve["by_priority_fraction"]] == [0.0, 1.0]
    assert curve["by_priority_tpot"][0]["replicas"] == fits[0].replicas


def test_a_plans_step_time_headroom_is_how_much_slower_its_steps_can_run(tmp_path):
    """The plan says how close to its workload's knee it sits: its fleet simulated with
    slower steps in turn, on top of any --step-time-margin, up to the first that misses.
    (The rates and the steps where the plans miss are this step model's: a change to the
    scheduler may move them.)"""
    MODEL.save(tmp_path / "profile.json")

    def plan(rate, margin):
        planner = Planner(preset("smollm2-135m"), PLAN_SLO, attainment=0.9,
                          step_time_profile=str(tmp_path / "profile.json"), price_per_hour=3.6,
                          step_time_margin=margin)
        workload = make_workload(f"poisson:rate={rate},n=80,priority=0.2,prompt=64-256,"
                                 "output=8-32,seed=1")
        fit = planner.search(workload, ["cpu-local"], ["shared"], [16], [512], 1)[0]
        margins, simulate = [], planner.simulate

        def recording(*args):
            margins.append(args[-1])
            return simulate(*args)

        planner.simulate = recording
        room = planner.step_time_headroom(fit, workload)
        planner.simulate = simulate
        return planner, fit, workload, room, margins

    def worst(planner, fit, workload, margin):
        s = planner.simulate(fit.cell, fit.replicas, workload, PLAN_SLO, margin)
        return min(s["tiers"][t]["slo_attainment"] for t in PLAN_SLO)

    planner, fit, workload, room, margins = plan(30, 0.0)    # near its knee
    assert margins == pytest.approx([0.05, 0.1, 0.2])
    assert room["holds_at_slower"] == 0.1 and room["misses"]["slower"] == 0.2
    assert worst(planner, fit, workload, 0.1) >= 0.9
    assert worst(planner, fit, workload, 0.2) == room["misses"]["attainment"] < 0.9
    assert describe_headroom(room) == (
        "meets every SLO with steps up to 10% slower than the step-time model; 20% slower, "
        f"the {room['misses']['tier']} tier meets {room['misses']['attainment']:.0%} "
        "(asked 90%)")
    room = plan(20, 0.0)[3]
    assert room["misses"] is None and room["holds_at_slower"] == 0.5
    assert describe_headroom(room).endswith("50% slower than the step-time model (the most tried)")
    planner, fit, workload, room, margins = plan(20, 0.2)    # 1.2 x 1.3 slower misses
    assert margins == pytest.approx([1.2 * (1 + x) - 1 for x in (0.05, 0.1, 0.2, 0.3)])
    assert room["holds_at_slower"] == 0.2 and room["misses"]["slower"] == 0.3
    assert "slower than the step-time model with its margin of 20%" in describe_headroom(room)
    assert describe_headroom({**room, "holds_at_slower": 0.0, "misses": {
        "slower": 0.05, "tier": None, "attainment": None}}) == (
        "at its workload's knee, with steps 5% slower than the step-time model with its "
        "margin of 20%: the simulated engine cannot run the workload")


def test_plan_says_so_when_nothing_meets_the_slos():
    planner = Planner(preset("llama-3-8b"), {"priority": (0.001, None)})
    with pytest.raises(ConfigError, match="no configuration meets every SLO") as info:
        planner.search(make_workload(PLAN_WORKLOAD), ["l4"], ["shared"], [16], [2048],
                       max_replicas=2)
    assert "\n" not in str(info.value) and "closest: l4 shared" in str(info.value)
    assert re.search(r"where the priority tier meets its SLO at \d+%", str(info.value))


def test_plan_and_sim_command_lines(capsys):
    code = main(["plan", "--workload", PLAN_WORKLOAD, "--slo", "priority=0.2,0.05",
                 "--slo", "default=1,0.1", "--hardware", "h100-sxm", "--max-num-seqs", "16",
                 "--max-num-batched-tokens", "2048", "--deployments", "shared",
                 "--max-replicas", "2", "--priority-fractions", "0,1", "--tpot-scales", "1",
                 "--format", "json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["fits"][0]["hardware"] == "h100-sxm"
    room = out["step_time_headroom"]
    assert room["margin"] == 0 and room["asked"] == 0.9
    assert room["holds_at_slower"] in (0.0, 0.05, 0.1, 0.2, 0.3, 0.5)
    assert len(out["fast_mode"]["by_priority_fraction"]) == 2
    assert main(["plan", "--workload", PLAN_WORKLOAD, "--slo", "priority=0.2,0.05",
                 "--slo", "default=1,0.1", "--hardware", "h100-sxm", "--max-num-seqs", "16",
                 "--max-num-batched-tokens", "2048", "--deployments", "shared",
                 "--max-replicas", "2", "--no-fast-mode-curve"]) == 0
    assert f"step-time headroom of #1: {describe_headroom(room)}" in capsys.readouterr().out
    code = main(["sim", "--workload", "poisson:rate=10,n=40,priority=0.3,output=4-16",
                 "--policy", "dedicated", "--format", "json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and [p["name"] for p in out["replicas"]] == ["fast0", "main0"]
    assert main(["plan", "--slo", "priority=0.001,", "--hardware", "l4", "--max-num-seqs",
                 "16", "--max-num-batched-tokens", "2048", "--deployments", "shared",
                 "--max-replicas", "1", "--workload", PLAN_WORKLOAD]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("error: no configuration meets every SLO")
    assert "Traceback" not in err


def test_model_shapes_from_a_preset_a_model_file_or_flags():
    from tierserve.errors import ConfigError
    from tierserve.model.loader import default_model_path
    from tierserve.model.metadata import resolve
    from tierserve.model.shapes import PRESETS

    assert resolve("llama-3-8b") is PRESETS["llama-3-8b"]
    custom = resolve("layers=32,hidden=4096,heads=32,kv_heads=8,intermediate=14336,"
                     "vocab=128256")
    assert custom.num_params == PRESETS["llama-3-8b"].num_params
    from_file = resolve(str(default_model_path()))  # the GGUF's metadata, no weights
    smol = PRESETS["smollm2-135m"]
    assert (from_file.num_layers, from_file.hidden_size, from_file.num_kv_heads) == \
        (smol.num_layers, smol.hidden_size, smol.num_kv_heads)
    for bad in ("layers=2,hidden=x", "layers=2", "no-such-model"):
        with pytest.raises(ConfigError):
            resolve(bad)


def test_a_hardware_file_is_checked_field_by_field_and_then_planned_on(tmp_path):
    """`--hardware-file`: a profile a user wrote; a missing, negative, unknown or
    out-of-range field is refused with its name; a good one is planned on and priced."""
    import json
    import subprocess
    import sys

    from tierserve.errors import ConfigError
    from tierserve.hardware.roofline import load_hardware

    good = {"name": "my-gpu", "bf16_tflops": 362, "mem_bw_tbs": 0.864, "mem_gb": 48,
            "eff_flops": 0.7, "price_per_hour": 1.1}
    for change, match in (({"mem_gb": None}, "field 'mem_gb' must be a number"),
                          ({"bf16_tflops": -1}, "field 'bf16_tflops' must be > 0"),
                          ({"eff_bw": 1.5}, "field 'eff_bw' is a fraction"),
                          ({"step_overhead_s": -0.1}, "field 'step_overhead_s' must be >= 0"),
                          ({"flops": 1}, "unknown field 'flops'")):
        path = tmp_path / "bad.json"
        path.write_text(json.dumps({**good, **change}))
        with pytest.raises(ConfigError, match=match):
            load_hardware(str(path))
    missing = {k: v for k, v in good.items() if k != "mem_bw_tbs"}
    (tmp_path / "missing.json").write_text(json.dumps(missing))
    with pytest.raises(ConfigError, match="missing field 'mem_bw_tbs'"):
        load_hardware(str(tmp_path / "missing.json"))
    (tmp_path / "my-gpu.json").write_text(json.dumps(good))
    assert load_hardware(str(tmp_path / "my-gpu.json")).price_per_hour == 1.1
    out = subprocess.run(
        [sys.executable, "-m", "tierserve.cli", "plan", "--hardware-file",
         str(tmp_path / "my-gpu.json"), "--slo", "default=2,0.1", "--workload",
         "poisson:rate=2,n=60,seed=1", "--no-fast-mode-curve", "--max-num-seqs", "64",
         "--max-num-batched-tokens", "2048", "--format", "json"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    fits = json.loads(out.stdout)
    first = (fits.get("fits") or fits.get("configurations") or [fits])[0] \
        if isinstance(fits, dict) else fits[0]
    assert "my-gpu" in json.dumps(first) and "1.1" in json.dumps(first)
    bad = subprocess.run([sys.executable, "-m", "tierserve.cli", "plan", "--hardware-file",
                          str(tmp_path / "missing.json"), "--slo", "default=2,0.1"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "missing field 'mem_bw_tbs'" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_an_int8_kv_cache_in_the_twin_holds_more_blocks_and_reads_half_the_bytes(capsys):
    """sim/plan --kv-cache-dtype int8, as `serve --kv-cache-dtype int8`: a replica's KV
    blocks are sized at a byte a value plus a float32 scale per token and KV head, so the
    same memory holds more of them, and the roofline's decode reads half the bytes."""
    from tierserve.sim.fleet import machine_for

    shape = preset("llama-3-8b")
    auto, int8 = (machine_for(shape, "h100-sxm", kv_cache_dtype=kv) for kv in ("auto", "int8"))
    ratio = shape.kv_bytes_per_token(2) / shape.kv_bytes_per_token(2, "int8")
    assert ratio == pytest.approx(2 * 128 / (128 + 4))              # head_dim 128
    assert int8.num_blocks == pytest.approx(auto.num_blocks * ratio, rel=1e-4)
    assert int8.model.per_kv_token_s == pytest.approx(
        auto.model.per_kv_token_s / ratio)
    assert int8.model.per_token_s == auto.model.per_token_s
    # where a run cannot carry it, the flag is refused, not ignored
    for argv in (["plan", "--hybrid", "x.jsonl", "--slo", "priority=1,0.1",
                  "--kv-cache-dtype", "int8"],
                 ["sim", "--schedule", "x.json", "--kv-cache-dtype", "int8"]):
        assert main(argv) == 1
        assert "--kv-cache-dtype" in capsys.readouterr().err.splitlines()[-1]
