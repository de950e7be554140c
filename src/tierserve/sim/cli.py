"""The simulator's commands: `tierserve sim` (and the planner, built on it)."""

import sys

from tierserve.errors import TierserveError


def cmd_sim(args) -> int:
    import time

    from tierserve.config import SchedulerConfig
    from tierserve.core.step_time import StepTimeModel
    from tierserve.metering.prices import machine_price
    from tierserve.model.shapes import preset
    from tierserve.sim.loop import Simulator
    from tierserve.sim.report import render, summarize
    from tierserve.sim.step_time import load_hardware, roofline
    from tierserve.sim.workload import make_workload

    shape = preset(args.model)
    slo = {}
    for item in args.slo or []:
        tier, _, values = item.partition("=")
        try:
            ttft, tpot = (float(v) if v else None for v in values.split(","))
        except ValueError:
            raise TierserveError(f"--slo wants TIER=TTFT_S,TPOT_S, got {item!r}") from None
        slo[tier] = (ttft, tpot)
    if args.step_time_profile:
        model, hw_name, mem_gb = StepTimeModel.load(args.step_time_profile), "cpu-local", None
    else:
        hw = load_hardware(args.hardware)
        model, hw_name, mem_gb = roofline(shape, hw, args.dtype_bytes, args.tp), hw.name, \
            hw.mem_gb * args.tp
    kv_block = shape.kv_bytes_per_token(args.dtype_bytes) * args.block_size
    if args.num_kv_blocks:
        num_blocks = args.num_kv_blocks
    elif mem_gb:
        free = 0.9 * mem_gb * 2**30 - shape.num_params * args.dtype_bytes
        if free < kv_block:
            raise TierserveError(f"{args.model} does not fit {hw_name} x{args.tp}: the weights "
                                 f"need {shape.num_params * args.dtype_bytes / 2**30:.0f} GiB")
        num_blocks = int(free // kv_block)
    else:
        num_blocks = int(args.kv_cache_memory_gb * 2**30 // kv_block)
    limit = args.priority_step_time_s
    if limit is None:
        limit = (slo.get("priority") or (None, None))[1] or 3 * model.predict_s([(1, 256)])
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             policy=args.policy, flex_max_wait_s=args.flex_max_wait_s)
    price = machine_price(hw_name, args.machine_price_per_hour) * args.tp
    max_len = min(shape.max_position_embeddings, num_blocks * args.block_size)
    workload = make_workload(args.workload)

    def progress(done, total):
        print(f"\rsim: {done}/{total} requests", end="", file=sys.stderr, flush=True)

    sim = Simulator(config, num_blocks, args.block_size, max_len, model, price,
                    step_time_limit_s=limit or None, progress=progress)
    start = time.perf_counter()
    result = sim.run(workload)
    print(f"\rsim: {len(result.requests)} requests in {time.perf_counter() - start:.1f} s "
          "of wall time", file=sys.stderr)
    desc = (f"--workload {args.workload} --model {args.model} --hardware {hw_name} x{args.tp} "
            f"--policy {args.policy} --max-num-seqs {args.max_num_seqs} "
            f"--max-num-batched-tokens {args.max_num_batched_tokens} kv_blocks={num_blocks} "
            f"price=${price}/h")
    print(render(summarize(result, slo), desc, args.format))
    return 0


def add_parsers(sub) -> None:
    sim = sub.add_parser("sim", help="simulate a workload: the real scheduler and cost meter, "
                                     "a step-time model instead of a GPU")
    sim.add_argument("--workload", required=True,
                     help="poisson:rate=2,n=500[,priority=0.2,flex=0.3,prompt=128-512,"
                          "output=32-256,seed=0] | gamma:...,cv=3 | trace:FILE.csv[,speed=1,"
                          "n=1000] | closed:users=16,n=500[,think=0]")
    sim.add_argument("--hardware", default="h100-sxm",
                     help="roofline profile: a100-80gb, h100-sxm, h200, l40s, l4 "
                          "(default h100-sxm)")
    sim.add_argument("--step-time-profile", default=None,
                     help="a `tierserve calibrate` JSON instead of the roofline (cpu-local)")
    sim.add_argument("--model", default="llama-3-8b",
                     help="model shape preset (default llama-3-8b)")
    sim.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    sim.add_argument("--dtype-bytes", type=int, default=2)
    sim.add_argument("--policy", default="tiered", choices=["tiered", "priority", "fcfs"])
    sim.add_argument("--max-num-seqs", type=int, default=256)
    sim.add_argument("--max-num-batched-tokens", type=int, default=2048)
    sim.add_argument("--block-size", type=int, default=16)
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
    sim.add_argument("--format", default="table", choices=["table", "json"])
    sim.set_defaults(func=cmd_sim)
