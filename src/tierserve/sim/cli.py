"""The simulator's commands: `tierserve sim` (one engine or a fleet; `--report
fast-vs-batch`) and `tierserve plan` (the capacity planner built on it).

About 430 lines, kept whole: the two commands share their model and machine flags
(`_add_model_args`) and the rules for which flags a mode refuses (--schedule, --hybrid,
--forecast), which read best beside each other."""

import os
import sys
import time

from tierserve.config import KV_CACHE_DTYPES
from tierserve.errors import TierserveError
from tierserve.tiers import TIER_NAMES as TIERS

BATCH_SIZES = "1,2,4,8,16,32,64,128,256"
# `plan` grid defaults (deployments, max_num_seqs, budgets): one workload, or every hour
PLAN_DEFAULTS = {"workload": ("shared,dedicated", "16,64,256", "2048,8192"),
                 "forecast": ("shared", "256", "2048")}


class Bar:
    """A `progress(done, total)` callback drawing tierserve.progress's bar on stderr."""

    def __init__(self, label: str):
        self.label, self.done, self._bar = label, 0, None

    def __call__(self, done: int, total: int) -> None:
        from tierserve.progress import Progress

        if self._bar is None:
            self._bar = Progress(self.label, total)
        self.done = done
        self._bar.update(done)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close(self.done)


def parse_slo(items: list[str] | None) -> dict:
    """`TIER=TTFT_S,TPOT_S` items (either value may be empty) -> tier -> (ttft, tpot)."""
    slo = {}
    for item in items or []:
        tier, _, values = item.partition("=")
        try:
            ttft, tpot = (float(v) if v else None for v in values.split(","))
        except ValueError:
            raise TierserveError(f"--slo wants TIER=TTFT_S,TPOT_S, got {item!r}") from None
        if tier not in TIERS:
            raise TierserveError(f"--slo: unknown tier {tier!r}; tiers: {', '.join(TIERS)}")
        slo[tier] = (ttft, tpot)
    return slo


def parse_list(text: str, kind=str, flag: str = "") -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise TierserveError(f"{flag} wants a comma-separated list, got {text!r}") from None
    if not values:
        raise TierserveError(f"{flag} is empty")
    return values


def resolve_policy(policy: str, deployment: str | None) -> tuple[str, str]:
    """The issue's `--policy shared|dedicated` are the tiered policy in that deployment."""
    if policy in ("shared", "dedicated"):
        if deployment not in (None, policy):
            raise TierserveError(f"--policy {policy} contradicts --deployment {deployment}")
        return "tiered", policy
    return policy, deployment or "shared"


def cmd_sim(args) -> int:
    from tierserve.config import SchedulerConfig
    from tierserve.model.metadata import resolve
    from tierserve.sim.fleet import (
        FleetConfig,
        machine_for,
        make_simulator,
        step_time_limit,
    )
    from tierserve.sim.report import plot, render, summarize
    from tierserve.sim.workload import make_workload

    if args.schedule:  # a schedule replayed on a weekly workload: its own report
        from tierserve.sim.replay import run as replay

        if args.kv_cache_dtype != "auto":
            raise TierserveError("--kv-cache-dtype does not apply to --schedule: a schedule "
                                 "replays the machines it names")
        if args.way_in_s is not None:
            raise TierserveError("--way-in-s does not apply to --schedule: a schedule "
                                 "replays the machines it names")

        return replay(args)
    slo = parse_slo(args.slo)
    if args.hardware_file:
        args.hardware = args.hardware_file
    machine = machine_for(resolve(args.model), args.hardware, args.tp, args.dtype_bytes,
                          args.block_size, args.num_kv_blocks, args.machine_price_per_hour,
                          args.step_time_profile, args.kv_cache_memory_gb,
                          args.kv_cache_dtype, args.way_in_s)
    policy, deployment = resolve_policy(args.policy, args.deployment)
    if args.report == "fast-vs-batch":
        return _fast_vs_batch(args, machine, policy)
    if not args.workload:
        raise TierserveError("sim needs --workload SPEC (or --report fast-vs-batch)")
    replicas = args.replicas
    if replicas is None:
        replicas = args.dedicated_replicas + 1 if deployment == "dedicated" else 1
    fleet = FleetConfig(
        replicas=replicas,
        router=args.router, deployment=deployment, dedicated_replicas=args.dedicated_replicas,
        dedicated_max_num_seqs=args.dedicated_max_num_seqs)
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             policy=policy, flex_max_wait_s=args.flex_max_wait_s)
    workload = make_workload(args.workload)
    bar = Bar("sim: requests")
    sim = make_simulator(machine, config, fleet,
                         step_time_limit(machine.model, slo, args.priority_step_time_s), bar,
                         slo)
    start = time.perf_counter()
    result = sim.run(workload)
    bar.close()
    print(f"sim: {len(result.requests)} requests in {time.perf_counter() - start:.1f} s of "
          "wall time", file=sys.stderr)
    desc = (f"--workload {args.workload} --model {args.model} --hardware {machine.hardware} "
            f"x{args.tp} --policy {policy} --max-num-seqs {args.max_num_seqs} "
            f"--max-num-batched-tokens {args.max_num_batched_tokens} {fleet.describe()} "
            f"kv_blocks={machine.num_blocks} price=${machine.price_per_hour}/h per replica"
            + (f" way_in={machine.way_in_s * 1e3:.1f}ms" if machine.way_in_s else ""))
    summary = summarize(result, slo)
    print(render(summary, desc, args.format))
    if args.plot:
        paths = plot(result, summary, args.plot)
        print(f"sim: wrote {', '.join(paths)}", file=sys.stderr)
    return 0


def _fast_vs_batch(args, machine, policy: str) -> int:
    from tierserve.sim.report import fast_vs_batch, render_fast_vs_batch

    sizes = parse_list(args.batch_sizes, int, "--batch-sizes")
    if min(sizes) < 1:
        raise TierserveError("--batch-sizes must be >= 1")
    bar = Bar("sim: batch sizes")
    start = time.perf_counter()
    report = fast_vs_batch(machine, sizes, args.prompt_tokens, args.output_tokens,
                           args.max_num_batched_tokens, policy, progress=bar)
    bar.close()
    print(f"sim: {len(sizes)} batch sizes in {time.perf_counter() - start:.1f} s of wall "
          "time", file=sys.stderr)
    desc = (f"--model {args.model} --hardware {machine.hardware} x{args.tp} "
            f"(${machine.price_per_hour}/h) prompt {args.prompt_tokens} output "
            f"{args.output_tokens} max_num_batched_tokens {args.max_num_batched_tokens}"
            + (f" way_in={machine.way_in_s * 1e3:.1f}ms" if machine.way_in_s else ""))
    print(render_fast_vs_batch(report, desc, args.format))
    return 0


def cmd_plan(args) -> int:
    from tierserve.model.metadata import resolve
    from tierserve.sim.plan import Planner, render
    from tierserve.sim.workload import make_workload

    slo = parse_slo(args.slo)
    given = parse_list(args.hardware, str, "--hardware") if args.hardware else \
        ([] if args.hardware_file else ["h100-sxm", "a100-80gb"])
    args.hardware = ",".join(given + list(args.hardware_file))
    for flag, given in (("--step-time-margin", args.step_time_margin),
                        ("--kv-cache-dtype", args.kv_cache_dtype != "auto")):
        if given and (args.hybrid or args.forecast):
            raise TierserveError(f"{flag} plans one workload: --hybrid and --forecast do not "
                                 "take it (a schedule has no field to replay it with)")
    if args.hybrid:
        return _plan_hybrid(args, slo)
    planner = Planner(resolve(args.model), slo, args.attainment, args.tp, args.dtype_bytes,
                      args.block_size, args.router, args.dedicated_replicas,
                      args.dedicated_max_num_seqs, step_time_margin=args.step_time_margin,
                      kv_cache_dtype=args.kv_cache_dtype)
    hardware = parse_list(args.hardware, str, "--hardware")
    # --forecast plans every hour, so its grid defaults are smaller (see PLAN_DEFAULTS)
    mode = "forecast" if args.forecast else "workload"
    deployments = parse_list(args.deployments or PLAN_DEFAULTS[mode][0], str, "--deployments")
    seqs = parse_list(args.max_num_seqs or PLAN_DEFAULTS[mode][1], int, "--max-num-seqs")
    budgets = parse_list(args.max_num_batched_tokens or PLAN_DEFAULTS[mode][2], int,
                         "--max-num-batched-tokens")
    if args.forecast:
        from tierserve.sim.hourly import run as plan_hours
        from tierserve.sim.plan import Cell

        planner.machine(hardware[0])  # the model must fit; only the first is planned on
        if len(deployments) != 1:
            raise TierserveError("--forecast plans one deployment: give --deployments "
                                 "shared or dedicated")
        return plan_hours(args, planner, [Cell(hardware[0], deployments[0], s, b)
                                          for s in seqs for b in budgets])
    workload = make_workload(args.workload)
    start = time.perf_counter()
    bar = Bar("plan: configurations")
    fits = planner.search(workload, hardware, deployments, seqs, budgets, args.max_replicas,
                          progress=bar)
    bar.close()
    headroom = planner.step_time_headroom(fits[0], workload)
    curve = None
    if not args.no_fast_mode_curve:
        bar = Bar("plan: fast-mode curve")
        curve = planner.fast_mode_curve(
            fits[0], workload, parse_list(args.priority_fractions, float,
                                          "--priority-fractions"),
            parse_list(args.tpot_scales, float, "--tpot-scales"), args.max_replicas, bar)
        bar.close()
    print(f"plan: {planner.num_simulations} simulations in "
          f"{time.perf_counter() - start:.1f} s of wall time", file=sys.stderr)
    desc = (f"--workload {args.workload} --model {args.model} x{args.tp} "
            + " ".join(f"--slo {t}={a if a is not None else ''},{b if b is not None else ''}"
                       for t, (a, b) in slo.items())
            + f" --attainment {args.attainment:g} --router {args.router}"
            + (f" --step-time-margin {args.step_time_margin:g}" if args.step_time_margin
               else ""))
    searched = (len(hardware) - len(planner.skipped)) * len(deployments) * len(seqs) \
        * len(budgets)
    print(render(fits, curve, desc, searched, planner.num_simulations, args.top,
                 planner.skipped, args.format, headroom))
    return 0


def _profiles(raw: str | None) -> tuple[str, str] | None:
    if raw is None:
        return None
    parts = [p for p in raw.split(",") if p]
    if len(parts) != 2:
        raise TierserveError(f"--hybrid-profiles takes SMALL.json,LARGE.json, got {raw!r}")
    for path in parts:
        if not os.path.isfile(path):
            raise TierserveError(f"--hybrid-profiles: no file {path}")
    return parts[0], parts[1]


def _plan_hybrid(args, slo: dict) -> int:
    from tierserve.model.metadata import resolve
    from tierserve.sim.hybrid import compare

    hardware = parse_list(args.hardware, str, "--hardware")[0]
    start = time.perf_counter()
    result = compare(resolve(args.model), resolve(args.hybrid), hardware,
                     args.hybrid_hardware or hardware, slo, args.hybrid_requests,
                     args.hybrid_rate, args.seed, args.max_replicas,
                     parse_list(args.max_num_seqs or "64,256", int, "--max-num-seqs"),
                     parse_list(args.max_num_batched_tokens or "2048", int,
                                "--max-num-batched-tokens"),
                     args.attainment, args.hard_share, args.tp,
                     _profiles(args.hybrid_profiles), args.hybrid_price_per_hour,
                     args.hybrid_output_tokens)
    print(f"plan --hybrid: {time.perf_counter() - start:.1f} s of wall time", file=sys.stderr)
    print(f"customer-service conversations: {args.hybrid_requests} at "
          f"{args.hybrid_rate:g}/s, {args.hard_share:.0%} hard (route/conversations.py)")
    print(result.render(args.hybrid, args.model))
    return 0


# ------------------------------------------------------------------ parsers
def _add_model_args(p) -> None:
    p.add_argument("--model", default="llama-3-8b",
                   help="model shape: a preset (llama-3-8b, the default; llama-3-70b, "
                        "llama-3.2-1b, qwen2.5-7b, smollm2-135m), a GGUF file or HF folder "
                        "(its config), or layers=32,hidden=4096,heads=32,kv_heads=8,"
                        "intermediate=14336,vocab=128256")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree per replica")
    p.add_argument("--dtype-bytes", type=int, default=2)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the replicas' KV cache: auto (--dtype-bytes a value) or int8 (a "
                        "byte a value and a float32 scale per token and KV head, as "
                        "`serve --kv-cache-dtype int8`): more blocks in the same memory, "
                        "and in the roofline half the KV reads")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--router", default="least-tokens",
                   choices=["least-tokens", "round-robin", "gateway"],
                   help="how arrivals are spread over replicas (default least-tokens: the "
                        "replica with the fewest outstanding prompt + output tokens; "
                        "gateway: fleet mode's own queues, AIMD limit and routing)")
    p.add_argument("--dedicated-replicas", type=int, default=1,
                   help="replicas that serve only priority in a dedicated deployment")
    p.add_argument("--dedicated-max-num-seqs", type=int, default=1,
                   help="max_num_seqs of each dedicated priority replica (default 1)")


def add_parsers(sub) -> None:
    sim = sub.add_parser("sim", help="simulate a workload: the real scheduler and cost meter, "
                                     "a step-time model instead of a GPU")
    sim.add_argument("--workload", default=None,
                     help="poisson:rate=2,n=500[,priority=0.2,flex=0.3,prompt=128-512,"
                          "output=32-256,seed=0] | gamma:...,cv=3 | diurnal:rate=2,peak=3,"
                          "period=86400,n=500 | trace:FILE.csv[,speed=1,n=1000] | "
                          "ledger:LEDGER.db[,speed=1,n=1000] | closed:users=16,n=500[,think=0]")
    sim.add_argument("--hardware", default="h100-sxm",
                     help="roofline profile: a100-80gb, h100-sxm, h200, l40s, l4 "
                          "(default h100-sxm)")
    sim.add_argument("--hardware-file", default=None, metavar="FILE.json",
                     help="a hardware profile you wrote (docs/hardware.md), instead of "
                          "--hardware")
    sim.add_argument("--step-time-profile", default=None,
                     help="a `tierserve calibrate` JSON instead of the roofline (cpu-local)")
    sim.add_argument("--way-in-s", type=float, default=None, metavar="SECONDS",
                     help="what a request spends outside a replica's steps (HTTP in and "
                          "out, a gateway's hop), added to its TTFT and end-to-end time "
                          "(default: the profile's way_in_s, which `calibrate --backend URL "
                          "--from-steps` measures; else 0)")
    _add_model_args(sim)
    sim.add_argument("--policy", default="tiered",
                     choices=["tiered", "priority", "fcfs", "shared", "dedicated"],
                     help="tiered (default), priority or fcfs; shared and dedicated mean "
                          "tiered in that deployment")
    sim.add_argument("--deployment", default=None, choices=["shared", "dedicated"],
                     help="shared (default): every replica takes every tier; dedicated: "
                          "priority on its own replica(s)")
    sim.add_argument("--replicas", type=int, default=None,
                     help="replicas in all, dedicated ones included (default 1; dedicated: "
                          "--dedicated-replicas + 1)")
    sim.add_argument("--max-num-seqs", type=int, default=256)
    sim.add_argument("--max-num-batched-tokens", type=int, default=2048)
    sim.add_argument("--num-kv-blocks", type=int, default=None,
                     help="default: what the hardware's memory holds after the weights")
    sim.add_argument("--kv-cache-memory-gb", type=float, default=1.0,
                     help="KV memory with --step-time-profile (default 1.0)")
    sim.add_argument("--priority-step-time-s", type=float, default=None,
                     help="tiered step-time cap (default: the priority TPOT SLO, else 3x a "
                          "lone decode step; 0: none)")
    sim.add_argument("--flex-max-wait-s", type=float, default=60.0)
    sim.add_argument("--slo", action="append", metavar="TIER=TTFT_S,TPOT_S",
                     help="an SLO to report attainment against (repeatable)")
    sim.add_argument("--machine-price-per-hour", type=float, default=None,
                     help="per device (default: the hardware's list price)")
    sim.add_argument("--plot", default=None, metavar="DIR",
                     help="also write latency_cdf.png (TTFT, e2e per tier) and cost_split.png")
    sim.add_argument("--report", default=None, choices=["fast-vs-batch"],
                     help="fast-vs-batch: cost per 1M output tokens, TTFT and TPOT at each "
                          "batch size (closed loop, fixed lengths), against batch 1")
    sim.add_argument("--batch-sizes", default=BATCH_SIZES,
                     help=f"for fast-vs-batch (default {BATCH_SIZES})")
    sim.add_argument("--prompt-tokens", type=int, default=512, help="for fast-vs-batch")
    sim.add_argument("--output-tokens", type=int, default=256, help="for fast-vs-batch")
    sim.add_argument("--format", default="table", choices=["table", "json"])
    r = sim.add_argument_group("schedule replay (from `tierserve plan --forecast --out`)")
    r.add_argument("--schedule", default=None, metavar="SCHEDULE.yaml",
                   help="replay the schedule (its hardware, model and SLOs) on --workload "
                        "weekly:peak=180,swing=5,weekend=0.5,noise=0.1,batch=0,days=7,... "
                        "beside the static fleets sized for the peak and for the mean")
    r.add_argument("--window-s", type=float, default=5.0,
                   help="simulated seconds standing for each hour (5)")
    r.add_argument("--max-replicas", type=int, default=16,
                   help="largest static fleet searched (16)")
    sim.set_defaults(func=cmd_sim)

    plan = sub.add_parser("plan", help="the cheapest fleets meeting every SLO for a "
                                       "workload, the cheapest one's step-time headroom, "
                                       "and what fast mode costs")
    plan.add_argument("--workload", default="poisson:rate=5,n=300,priority=0.2",
                      help="as for sim (default poisson:rate=5,n=300,priority=0.2)")
    plan.add_argument("--slo", action="append", metavar="TIER=TTFT_S,TPOT_S",
                      help="an SLO every configuration must meet (repeatable; at least one)")
    plan.add_argument("--attainment", type=float, default=0.9,
                      help="share of each SLO tier's requests within both targets (0.9)")
    plan.add_argument("--hardware", default=None,
                      help="candidate hardware profiles (default h100-sxm,a100-80gb; none "
                           "with --hardware-file unless given)")
    plan.add_argument("--hardware-file", action="append", default=[], metavar="FILE.json",
                      help="a hardware profile you wrote (docs/hardware.md), one more "
                           "candidate (repeatable)")
    _add_model_args(plan)
    plan.add_argument("--max-replicas", type=int, default=4)
    plan.add_argument("--step-time-margin", type=float, default=0.0, metavar="FRACTION",
                      help="plan as if every step took this fraction longer than the "
                           "hardware's model predicts (0); a machine that drifts from its "
                           "calibration, such as a shared VM, needs the drift it shows "
                           "(not with --hybrid or --forecast)")
    plan.add_argument("--max-num-seqs", default=None,
                      help="candidates (16,64,256; with --forecast 256)")
    plan.add_argument("--max-num-batched-tokens", default=None,
                      help="candidates (2048,8192; with --forecast 2048)")
    plan.add_argument("--deployments", default=None,
                      help="candidates (shared,dedicated; with --forecast one: shared)")
    plan.add_argument("--top", type=int, default=5, help="configurations to list (5)")
    plan.add_argument("--priority-fractions", default="0,0.1,0.2,0.5,1",
                      help="priority shares of the fast-mode curve (0,0.1,0.2,0.5,1)")
    plan.add_argument("--tpot-scales", default="0.5,1,2",
                      help="priority TPOT targets of the curve, x the given (0.5,1,2)")
    plan.add_argument("--no-fast-mode-curve", action="store_true",
                      help="skip the fast-mode curve")
    plan.add_argument("--format", default="table", choices=["table", "json"])
    h = plan.add_argument_group("hybrid: a small model's fast lane beside the large model")
    h.add_argument("--hybrid", default=None, metavar="SMALL",
                   help="compare all requests on --model in the priority tier with simple "
                        "turns on SMALL (priority) and hard ones on --model (default), on "
                        "the customer-service workload; needs --slo priority= and default=")
    h.add_argument("--hybrid-hardware", default=None,
                   help="hardware of the small model's pool (default: the first --hardware)")
    h.add_argument("--hybrid-requests", type=int, default=600)
    h.add_argument("--hybrid-rate", type=float, default=10.0, help="arrivals per second")
    h.add_argument("--hard-share", type=float, default=0.3)
    h.add_argument("--hybrid-profiles", default=None, metavar="SMALL.json,LARGE.json",
                   help="`tierserve calibrate` files of the two models on this CPU (the "
                        "pools are cpu-local machines) instead of --hardware's rooflines; "
                        "a file's way_in_s (from --from-steps) is added to its TTFTs")
    h.add_argument("--hybrid-price-per-hour", type=float, default=None,
                   help="with --hybrid-profiles: USD per hour of one replica's machine")
    h.add_argument("--hybrid-output-tokens", type=int, default=None,
                   help="every request's output tokens (as a benchmark sends them with "
                        "ignore_eos); default: drawn per class")
    h.add_argument("--seed", type=int, default=0)
    f = plan.add_argument_group("hour by hour (from `tierserve forecast --out`)")
    f.add_argument("--forecast", default=None, metavar="FILE",
                   help="plan each forecast hour (on the first --hardware) and print the "
                        "schedule: replicas, max_num_seqs, budget, reserved priority slots, "
                        "batch hours")
    f.add_argument("--prewarm", default="30m",
                   help="lead time: capacity is ready this long before its hour (30m)")
    f.add_argument("--out", default=None, metavar="SCHEDULE.yaml",
                   help="write the schedule (YAML) for `sim --schedule` and the server")
    f.add_argument("--headroom", default="mape",
                   help="plan for the forecast raised by this fraction; mape (default): by "
                        "the forecast's backtest MAPE")
    f.add_argument("--window-s", type=float, default=5.0,
                   help="simulated seconds standing for each hour (5)")
    f.add_argument("--min-batch-hours", type=int, default=6,
                   help="batch hours per day at least, the quietest (6)")
    plan.set_defaults(func=cmd_plan)
