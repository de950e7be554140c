"""The simulator against the real engine on this machine.

The engine calibrates its step-time model at startup (the grid in engine/calibrate.py).
The simulator plans with that model, as the engine does, and takes its step durations
from one fitted on the same grid to whole engine steps (so its scheduler learns the
measured/predicted ratio the engine learns); then held-out open-loop workloads (other
rates, a tier mix, other lengths than the grid) run through the engine and, with the same
arrivals, lengths and tiers, through the simulator using its model. For each policy and
rate, per tier: TTFT p50/p90/p99, TPOT p50/p99 and SLO attainment of both, and total
throughput; one line per rate with the absolute percentage errors (attainment: points,
beside the engine's own with every time 5% longer and shorter: see EDGE). The headline
median is over TTFT p50, p90 and TPOT p50 (comparable with earlier runs); a second one
takes the p99s in too.

NOTE: when the twin is calibrated. Right before each rate's run, as a user would run
`tierserve calibrate` before `sim`: on a 2-core Zen 5 VM the same calibration predicted a
lone decode step at 10.3 ms at one moment and 12.2 ms eight minutes later, and the whole
twin was as far off as the machine had drifted.

NOTE: the floor. `--floor` runs the engine a second time on the same arrivals. On a
shared 2-vCPU VM the same lone decode step wanders 16-24 ms from one second to the next
(steal time 0-3%, so not visible to the guest), and near capacity that spread moves
queueing delays a lot: the engine against itself is the bar no twin can pass here.

NOTE: rounds. `--repeats N` runs each rate N times, each round calibrated right before
its run, on the same arrivals. Besides every round's own errors it prints the twin's
cell-by-cell median over the rounds against the engine's: the twin's own error, with the
machine's drift between rounds left to the medians (on a 2-vCPU EPYC Zen 3 a lone
decode's calibration moved 27.5 -> 34.7 ms within minutes, and steps ran 0.8-1.3x a
calibration made just before). It also prints every pair of rounds' engines apart: the
engine against itself across calibrations and minutes, beside --floor's back-to-back
runs. One round is a sample of the machine; a twin predicts what it does on average.

NOTE: drift taken out. With `--steps` each round also runs the twin with its step times
scaled by the mean of the run's own steps over the whole-step model's prediction (as
benchmarks/fleet_twin.py does per replica). That factor is read off the run, so the line
is a diagnostic, not a prediction: what is left is what the twin's scheduling, queueing
and step shapes get wrong, with the machine's move since the calibration taken out.
"""

import argparse
import statistics
import time

from tierserve.core.stats import percentile as pct
from tierserve.tiers import Tier

TIERS = tuple(t.label for t in Tier if t != Tier.BATCH)
HEADLINE = ("ttft_p50", "ttft_p90", "tpot_p50")
CELLS = ("ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p99")


def add_args(p: argparse.ArgumentParser) -> None:
    from tierserve.bench.plan_check import SLO_DEFAULT

    p.add_argument("--rates", default="1,2", help="request rates (req/s)")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--policies", default="tiered",
                   help="scheduling policies to compare, comma-separated (tiered, fcfs, "
                        "priority)")
    p.add_argument("--slo", action="append", default=None, metavar="TIER=TTFT_S,TPOT_S",
                   help="targets the attainment is counted against, as `tierserve plan "
                        "--slo`, repeatable (default: " + " ".join(SLO_DEFAULT) + "); the "
                        "engine is not told them")
    p.add_argument("--bench-seed", type=int, default=99)
    p.add_argument("--steps", action="store_true",
                   help="also print the whole-step model's error on the engine's own steps "
                        "by kind of step (decodes alone by batch size, prefills, mixed), and the "
                        "twin again with the run's drift taken out (a diagnostic: the factor is "
                        "read off the run)")
    p.add_argument("--floor", action="store_true",
                   help="also run the engine a second time on each rate's arrivals and "
                        "print how far its two runs are apart, cell by cell: the noise "
                        "floor under any twin's error on this machine")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds per rate (each calibrated right before its run, on the "
                        "same arrivals); with 2 or more also compares the twin's and the "
                        "engine's cell-by-cell medians over the rounds, and the rounds' "
                        "engines pair by pair (the engine against itself across rounds)")


EDGE = 0.05
"""How far the engine's attainment moves with every time EDGE longer or shorter: beside
the twin's points apart, the bar a twin whose times are off by the issue's 5% can meet.
Where a tier's SLO sits at the middle of its times (a 50 ms TPOT SLO against a 50-56 ms
median on a 2-core Zen 3, float32) 5% moves it by tens of points."""


def figures(rows: list[dict], wall: float, slo: dict) -> dict:
    """Throughput, and per tier the latency cells and the share meeting its SLO (also
    with every time EDGE longer, `attainment_slow`, and shorter, `attainment_fast`)."""
    out = {"tok_s": sum(r["output_tokens"] for r in rows) / wall}
    for tier in TIERS:
        rs = [r for r in rows if r["tier"] == tier]
        if rs:
            ttft, tpot = [r["ttft_s"] for r in rs], [r["tpot_s"] for r in rs]
            cells = {f"ttft_p{q}": pct(ttft, q / 100) for q in (50, 90, 99)}
            cells.update({f"tpot_p{q}": pct(tpot, q / 100) for q in (50, 99)})
            if tier in slo:
                a, b = slo[tier]
                for key, scale in (("attainment", 1.0), ("attainment_slow", 1 + EDGE),
                                   ("attainment_fast", 1 - EDGE)):
                    cells[key] = sum(
                        (a is None or (r["ttft_s"] is not None and r["ttft_s"] * scale <= a))
                        and (b is None or r["tpot_s"] is None or r["tpot_s"] * scale <= b)
                        for r in rs) / len(rs)
            out[tier] = cells
    return out


def run(args) -> None:
    from tierserve.bench.plan_check import SLO_DEFAULT
    from tierserve.sim.cli import parse_list, parse_slo

    slo = parse_slo(args.slo or SLO_DEFAULT)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1 (got {args.repeats})")
    errors = {"headline": [], "all": [], "points": [], "floor": [], "pooled": [],
              "pooled_all": [], "pooled_points": [], "rounds_floor": [], "drift_out": [],
              "edge": []}
    for policy in parse_list(args.policies, str, "--policies"):
        _one_policy(args, policy, slo, errors)
    print(f"sim_accuracy policies={args.policies} rates={args.rates} median absolute error "
          f"over tiers x (TTFT p50, p90, TPOT p50): {_median(errors['headline']):.0%} (target "
          f"<= 5%); with the p99s: {_median(errors['all']):.0%}; attainment at most "
          f"{max(errors['points'], default=0):.0f} points apart (target 5; {EDGE:.0%} on "
          f"every time moves the engine's own by up to "
          f"{max(errors['edge'], default=0):.0f})"
          + (f"; the engine against itself: {_median(errors['floor']):.0%}"
             if errors["floor"] else "")
          + (f"; over {args.repeats} rounds (cell-by-cell medians): "
             f"{_median(errors['pooled']):.1%}, with the p99s {_median(errors['pooled_all']):.1%}"
             f", attainment at most {max(errors['pooled_points'], default=0):.0f} points apart"
             f"; the rounds' engines pair by pair: {_median(errors['rounds_floor']):.0%}"
             if args.repeats > 1 else "")
          + (f"; per round as the first figure, with each run's drift taken out (a "
             f"diagnostic read off the run, not a prediction): "
             f"{_median(errors['drift_out']):.1%}" if errors["drift_out"] else ""),
          flush=True)


def _one_policy(args, policy: str, slo: dict, errors: dict) -> None:
    from tierserve.bench.tiers import make_workload
    from tierserve.engine.llm_engine import LLMEngine
    from tierserve.llm import engine_config

    engine = LLMEngine(engine_config(max_num_seqs=args.max_num_seqs, policy=policy))
    for rate in [float(r) for r in args.rates.split(",")]:
        arrivals = make_workload(rate, args.requests, args.bench_seed + int(rate * 10), 0.2, 0.3)
        rounds = [_one_round(args, engine, policy, rate, arrivals, slo, errors)
                  for _ in range(args.repeats)]
        if args.repeats > 1:
            engines, twins = _cellwise_median([r for r, _ in rounds]), _cellwise_median(
                [s for _, s in rounds])
            for i, (first, _) in enumerate(rounds):  # every pair: as --floor's two runs
                for second, _ in rounds[i + 1:]:
                    _compare(first, second, {"headline": errors["rounds_floor"]})
            print(f"sim_accuracy policy={policy} rate={rate:g} median of {args.repeats} rounds "
                  f"(engine/sim, abs error) | " + _compare(
                      engines, twins, {"headline": errors["pooled"], "all": errors["pooled_all"],
                                       "points": errors["pooled_points"]}), flush=True)


def _one_round(args, engine, policy: str, rate: float, arrivals: list, slo: dict,
               errors: dict) -> tuple[dict, dict]:
    """Calibrate, run the engine on `arrivals`, run the twin on them; print the round's
    line and return both figures."""
    from tierserve.bench.tiers import run_open_loop, step_drift
    from tierserve.engine.calibrate import calibrate

    model = engine.scheduler.step_time_model  # what the engine plans with (None: no cap)
    began = time.perf_counter()
    whole = calibrate(engine, whole_step=True)  # the simulator's steps: whole steps,
    print(f"sim_accuracy policy={policy} rate={rate:g} whole-step model "  # measured
          f"({time.perf_counter() - began:.0f} s to calibrate, just before the run): "
          f"{whole.summary()}", flush=True)
    measured_steps = [] if args.steps else None
    real = run_open_loop(engine, arrivals, measured_steps)
    fr = figures(real["requests"], real["wall_s"], slo)
    if args.steps:
        print(f"sim_accuracy policy={policy} rate={rate:g} steps: "
              + step_residuals(whole, measured_steps), flush=True)
    engine.block_manager.reset_prefix_cache()
    if args.floor:
        again = run_open_loop(engine, arrivals)
        engine.block_manager.reset_prefix_cache()
        print(f"sim_accuracy policy={policy} rate={rate:g} engine twice (first/second, "
              "abs difference): " + _compare(fr, figures(again["requests"],
                                                         again["wall_s"], slo),
                                             {"headline": errors["floor"]}), flush=True)
    fs = _twin(engine, model, whole, arrivals, slo)
    ratio = engine.scheduler.step_time_ratio if model is not None else None
    print(f"sim_accuracy policy={policy} rate={rate:g} requests={args.requests} "
          f"max_num_seqs={args.max_num_seqs} (engine/sim, abs error) | "
          + _compare(fr, fs, errors)
          + (f" | engine's measured/predicted step ratio {ratio:.2f}" if ratio else ""),
          flush=True)
    moved = step_drift(whole, measured_steps) if measured_steps else float("nan")
    if moved == moved:   # (NaN: no step to read it from)
        # a diagnostic only, not a prediction (the drift is read off the run itself): the
        # twin again with its steps scaled by the mean of the run's measured/predicted,
        # which leaves what the twin's scheduling and queueing get wrong
        print(f"sim_accuracy policy={policy} rate={rate:g} drift taken out (the run's steps "
              f"{moved:.2f}x the model, mean; engine/sim, abs error) | "
              + _compare(fr, _twin(engine, model, whole.scaled(moved), arrivals, slo),
                         {"headline": errors["drift_out"]}), flush=True)
    return fr, fs


def _twin(engine, model, whole, arrivals: list, slo: dict) -> dict:
    """The simulator, configured as `engine`, planning with `model` (the engine's own:
    None for no cap) and taking its step times from `whole`, on `arrivals`: figures()."""
    from tierserve.bench.tiers import SYSTEM_PROMPT
    from tierserve.config import SchedulerConfig
    from tierserve.sim.loop import Simulator
    from tierserve.sim.workload import SimRequest

    sc = engine.config.scheduler
    sim = Simulator(SchedulerConfig(max_num_seqs=sc.max_num_seqs,
                                    max_num_batched_tokens=sc.max_num_batched_tokens,
                                    policy=sc.policy, priority_guard_s=sc.priority_guard_s,
                                    default_aging_s=sc.default_aging_s,
                                    flex_max_wait_s=sc.flex_max_wait_s),
                    engine.block_manager.num_blocks, engine.block_manager.block_size,
                    engine.max_model_len, whole, 0.1,
                    step_time_limit_s=engine.scheduler.step_time_limit_s,
                    plan_model=model)
    result = sim.run([SimRequest(a.t, a.tier, len(a.prompt), a.max_tokens,
                                 shared_prefix=len(SYSTEM_PROMPT)) for a in arrivals])
    simulated = [{"tier": r.tier.label, "ttft_s": r.ttft_s, "tpot_s": r.tpot_s,
                  "output_tokens": r.num_output_tokens} for r in result.requests]
    first = min(r.arrival_time for r in result.requests)
    return figures(simulated, max(r.finished_time for r in result.requests) - first, slo)


def _cellwise_median(runs: list[dict]) -> dict:
    """Throughput and every tier's cells, each the median over `runs` (figures' dicts)."""
    out = {"tok_s": statistics.median(r["tok_s"] for r in runs)}
    for tier in TIERS:
        have = [r[tier] for r in runs if tier in r]
        if have:
            out[tier] = {k: (statistics.median(vs) if (vs := [c[k] for c in have
                                                              if c.get(k) is not None])
                             else None)
                         for k in have[0]}
    return out


def _compare(ref: dict, other: dict, errors: dict) -> str:
    """Throughput and, per tier, the latency cells and attainment of `other` against `ref`
    (the engine's run), as "ref/other (abs error)" cells; the errors are appended to
    `errors` ("headline": the three cells kept from earlier runs, "all": every latency
    cell, "points": attainment apart), each list only if `errors` has it."""
    parts = [f"tok/s {ref['tok_s']:.1f}/{other['tok_s']:.1f} "
             f"({_err(other['tok_s'], ref['tok_s']):.0%})"]
    for tier in TIERS:
        if tier not in ref:
            continue
        cells = []
        for k in CELLS:
            e = _err(other[tier][k], ref[tier][k])
            for key in ("headline",) * (k in HEADLINE) + ("all",):
                errors.get(key, []).append(e)
            cells.append(f"{k} {_ms(ref[tier][k])}/{_ms(other[tier][k])}ms ({e:.0%})")
        if "attainment" in ref[tier]:
            a, b = ref[tier]["attainment"], other[tier]["attainment"]
            lo, hi = ref[tier]["attainment_slow"], ref[tier]["attainment_fast"]
            errors.get("points", []).append(abs(a - b) * 100)
            errors.get("edge", []).append(max(a - lo, hi - a) * 100)
            cells.append(f"attainment {a:.0%}/{b:.0%} (the engine's with times "
                         f"{EDGE:.0%} longer / shorter: {lo:.0%} / {hi:.0%})")
        parts.append(f"{tier}: " + " ".join(cells))
    return " | ".join(parts)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def _median(values: list[float]) -> float:
    values = [v for v in values if v == v]  # a cell neither run has (nan) is left out
    return statistics.median(values) if values else float("nan")


def step_kind(seqs: list[tuple[int, int]]) -> str:
    """decode xB / prefill / mixed xB (B: decodes in it, binned)."""
    decodes = sum(1 for n, _ in seqs if n == 1)
    b = next(f"{lo}-{hi}" if lo != hi else str(lo)
             for lo, hi in ((1, 1), (2, 4), (5, 16), (17, 64), (65, 1 << 30))
             if decodes <= hi) if decodes else "0"
    if decodes == len(seqs):
        return f"decode x{b}"
    return "prefill" if not decodes else f"mixed x{b}"


def step_residuals(model, steps: list[tuple[list[tuple[int, int]], float]]) -> str:
    """Per kind of step: count, share of the engine's time, and measured/predicted (sum
    over sum, and the median of the ratios)."""
    kinds: dict[str, list[tuple[float, float]]] = {}
    for seqs, seconds in steps:
        kinds.setdefault(step_kind(seqs), []).append((seconds, model.predict_s(seqs)))
    total = sum(m for _, m in steps) or 1.0
    parts = []
    for kind in sorted(kinds):
        rows = kinds[kind]
        meas, pred = sum(m for m, _ in rows), sum(q for _, q in rows)
        med = statistics.median(m / q for m, q in rows if q > 0)
        parts.append(f"{kind} n={len(rows)} time={meas / total:.0%} "
                     f"measured/predicted={meas / pred:.2f} (median {med:.2f})")
    pred = sum(q for rows in kinds.values() for _, q in rows)
    return (" | ".join(parts)
            + f" | all n={len(steps)} measured/predicted={total / (pred or 1.0):.2f}")


def _err(sim: float | None, real: float | None) -> float:
    if sim is None or real is None or real == 0:
        return float("nan")
    return abs(sim - real) / real
