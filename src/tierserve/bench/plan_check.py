"""A plan checked against a real run (issue 34, item 3): `tierserve plan` on this machine's
calibration recommends a configuration for a workload and SLOs; the engine then runs that
configuration on the same arrivals, and both are summarized by the same report code.

    python benchmarks/plan_check.py [--rate 1.0] [--requests 80] [--cells best|all]

1. Calibrate: an engine of the default model (`--quantization`, as `make serve` runs it)
   fits a whole-step model on the calibration grid (what `tierserve plan
   --step-time-profile` takes: hardware `cpu-local`, priced at `--price-per-hour`).
2. Plan: the planner searches max_num_seqs x max_num_batched_tokens on one replica (this
   machine) for the open-loop workload of benchmarks/tiers.py (Poisson arrivals at
   `--rate`, 20% priority chats, 30% flex, the rest default work, a shared system
   prompt) and the SLOs; the cheapest configuration that meets them is the plan.
3. Run: a fresh engine with that configuration (its tiered cap set from the priority
   TPOT target by the rule the planner's simulation uses, core/tier_rules.py) serves the
   same arrivals in real time, its cost meter priced like the plan's.
   `sim.report.summarize` reads both runs.

Prints the plan's step-time headroom (how much slower than the profile its steps can run
before it misses an SLO, `Planner.step_time_headroom`); per configuration run, predicted
and measured SLO attainment per tier (points apart), machine cost per 1K output tokens
(relative error) and the run's steps over the profile's prediction (mean: how far the
machine moved since the calibration); then one summary line.
The run is the in-process engine: the time an HTTP server adds is not in either side.
"""

import argparse
import os
import sys
import tempfile
import time

from tierserve.core.stats import StatsCollector

SLO_DEFAULT = ["priority=0.5,0.05", "default=4,0.15"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", type=float, default=1.0, help="arrivals per second")
    p.add_argument("--requests", type=int, default=80)
    p.add_argument("--slo", action="append", default=None, metavar="TIER=TTFT_S,TPOT_S",
                   help="as `tierserve plan --slo`, repeatable (default: "
                        + " ".join(SLO_DEFAULT) + ")")
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--max-num-seqs", default="4,8,16,32", help="the grid (comma-separated)")
    p.add_argument("--max-num-batched-tokens", default="256,512")
    p.add_argument("--quantization", default="gguf", help="as `make serve` (none: bf16)")
    p.add_argument("--price-per-hour", type=float, default=3.6)
    p.add_argument("--step-time-margin", type=float, default=0.0, metavar="FRACTION",
                   help="as `tierserve plan --step-time-margin`: the plan and its "
                        "predictions assume steps this fraction slower than calibrated")
    p.add_argument("--cells", choices=("best", "all"), default="best",
                   help="run the plan only, or every configuration of the grid")
    p.add_argument("--bench-seed", type=int, default=34)


def calibrate_profile(quantization: str | None, path: str) -> None:
    from tierserve.engine.calibrate import calibrate
    from tierserve.engine.llm_engine import LLMEngine
    from tierserve.llm import engine_config

    engine = LLMEngine(engine_config(quantization=quantization, priority_step_time_s=0))
    calibrate(engine, whole_step=True).save(path, source="plan_check whole-step calibration")


def run_real(cell, slo: dict, arrivals, quantization, price: float, model):
    """The configuration `cell` on the engine, the arrivals in real time: a SimResult, so
    the planner's own summary reads it; the wall time; and the mean of the run's steps
    over what `model` predicts for them (how far the machine moved from the profile)."""
    from tierserve.bench.tiers import run_open_loop, step_drift
    from tierserve.engine.llm_engine import LLMEngine
    from tierserve.llm import engine_config
    from tierserve.metering.cost import CostMeter
    from tierserve.sim.loop import SimResult

    engine = LLMEngine(engine_config(
        quantization=quantization, max_num_seqs=cell.max_num_seqs,
        max_num_batched_tokens=cell.max_num_batched_tokens,
        slo={t: {"ttft_s": a, "tpot_s": b} for t, (a, b) in slo.items()}))
    meter = CostMeter(price, work_model=model)
    engine.set_metering(meter)
    collector = StatsCollector()
    engine.add_sink(collector)
    start, shapes = time.perf_counter(), []
    run_open_loop(engine, arrivals, shapes)
    meter.close_window(engine.clock.now())
    reqs, steps, sched = collector.requests, collector.steps, engine.scheduler
    makespan = max(r.finished_time for r in reqs) - min(r.arrival_time for r in reqs)
    wall = time.perf_counter() - start
    return SimResult(reqs, makespan, sum(s.duration_s for s in steps), len(steps),
                     dict(sched.preemptions_by_tier), dict(sched.recomputed_tokens_by_tier),
                     sum(s.kv_usage for s in steps) / max(len(steps), 1),
                     meter), wall, step_drift(model, shapes)


def run(args) -> None:
    from tierserve.bench.tiers import make_workload
    from tierserve.core.step_time import StepTimeModel
    from tierserve.engine.calibrate import cpu_model
    from tierserve.model.shapes import preset
    from tierserve.sim.plan import Cell, Planner, describe_headroom
    from tierserve.sim.cli import parse_list, parse_slo
    from tierserve.sim.report import summarize
    from tierserve.sim.workload import SimRequest

    quantization = None if args.quantization == "none" else args.quantization
    slo = parse_slo(args.slo or SLO_DEFAULT)
    seqs = parse_list(args.max_num_seqs, int, "--max-num-seqs")
    budgets = parse_list(args.max_num_batched_tokens, int, "--max-num-batched-tokens")
    arrivals = make_workload(args.rate, args.requests, args.bench_seed, 0.2, 0.3)
    workload = [SimRequest(a.t, a.tier, len(a.prompt), a.max_tokens,
                           prompt_ids=tuple(a.prompt)) for a in arrivals]
    with tempfile.TemporaryDirectory() as tmp:
        profile = os.path.join(tmp, "profile.json")
        planner = Planner(preset("smollm2-135m"), slo, args.attainment,  # bad flags fail
                          step_time_profile=profile, price_per_hour=args.price_per_hour,
                          seed=args.bench_seed, step_time_margin=args.step_time_margin)
        calibrate_profile(quantization, profile)  # before this (read when first planned)
        model = StepTimeModel.load(profile)
        fits = planner.search(workload, ["cpu-local"], ["shared"], seqs, budgets, 1)
        best = fits[0]
        headroom = planner.step_time_headroom(best, workload)
        print(f"plan_check plan {best.cell.describe()} | step-time headroom: "
              + describe_headroom(headroom), flush=True)
        cells = [best.cell] if args.cells == "best" else \
            [Cell("cpu-local", "shared", s, b) for s in seqs for b in budgets]
        worst_points, cost_errors, plan_measured, moved = [], [], [], None
        for cell in cells:
            predicted = planner.simulate(cell, 1, workload, slo)
            measured_result, wall, drift = run_real(cell, slo, arrivals, quantization,
                                                    args.price_per_hour, model)
            if cell == best.cell:
                moved = drift
            measured = summarize(measured_result, slo)
            parts = []
            for tier in slo:
                p = predicted["tiers"].get(tier, {}).get("slo_attainment")
                m = measured["tiers"].get(tier, {}).get("slo_attainment")
                if p is None or m is None:
                    continue
                worst_points.append(abs(p - m) * 100)
                if cell == best.cell:
                    plan_measured.append(m)
                pt, mt = predicted["tiers"][tier], measured["tiers"][tier]
                parts.append(f"{tier} attainment predicted {p:.0%} measured {m:.0%} "
                             f"({abs(p - m) * 100:.0f} points; predicted/measured TTFT p90 "
                             f"{_ms(pt['ttft_p90_s'])}/{_ms(mt['ttft_p90_s'])} ms, TPOT p99 "
                             f"{_ms(pt['tpot_p99_s'])}/{_ms(mt['tpot_p99_s'])} ms)")
            pc = predicted["bill"]["cost_per_1m_output"] / 1e3
            mc = measured["bill"]["cost_per_1m_output"] / 1e3
            cost_errors.append(abs(pc - mc) / mc)
            tag = "plan" if cell == best.cell else "cell"
            print(f"plan_check {tag} {cell.describe()} | " + " | ".join(parts)
                  + f" | cost per 1K output predicted ${pc:.5f} measured ${mc:.5f} "
                  f"({abs(pc - mc) / mc:.0%}) | makespan predicted {predicted['makespan_s']:.1f}"
                  f" s measured {measured['makespan_s']:.1f} s (wall {wall:.0f} s) | the run's "
                  f"steps {_ratio(drift)} the profile (mean)", flush=True)
    base = 1 + args.step_time_margin   # the headroom is on top of the margin
    held = base * (1 + headroom["holds_at_slower"])
    miss = base * (1 + headroom["misses"]["slower"]) if headroom["misses"] else None
    print(f"plan_check cpu={cpu_model()!r} quantization={args.quantization} rate={args.rate:g} "
          f"requests={args.requests} slo={' '.join(args.slo or SLO_DEFAULT)!r} "
          f"attainment={args.attainment:g} step_time_margin={args.step_time_margin:g} "
          f"grid seqs={args.max_num_seqs} budgets={args.max_num_batched_tokens} "
          f"plan={best.cell.describe()}: attainment apart at most "
          f"{max(worst_points, default=0):.0f} points (target 5), cost per 1K output apart "
          f"at most {max(cost_errors, default=0):.0%} (target 10%); the plan measured "
          + (f"{min(plan_measured):.0%}" if plan_measured else "-")
          + f" in its worst SLO tier (asked {args.attainment:.0%}); it met every SLO in the "
          f"twin with steps up to {held:.2f}x the profile"
          + (f", missed at {miss:.2f}x" if miss else "") + "; its run's steps were "
          + _ratio(moved), flush=True)


def _ratio(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.2f}x"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def main(argv=None) -> int:
    from tierserve.errors import TierserveError

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(p)
    try:
        run(p.parse_args(argv))
    except TierserveError as exc:  # a bad flag, or no configuration meets the SLOs
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
