"""The `tierserve` command line. Every TierserveError becomes one line and exit code 1.

Why one file of about 400 lines: every subcommand's parser sits beside its thin handler
(the work is in the packages), so `--help` reads against the README in one place."""

import argparse
import functools
import sys

from tierserve.engine_args import Remember, add_engine_args, engine_config_from_args
from tierserve.errors import TierserveError


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="most output tokens")
    g.add_argument("--min-tokens", type=int, default=0, help="no EOS before this many tokens")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed-request", dest="request_seed", type=int, default=None,
                   help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=None,
                   help="stop string (repeatable); not included in the output")
    g.add_argument("--ignore-eos", action="store_true", help="generate past EOS")


def cmd_generate(args) -> int:
    from tierserve.engine.llm_engine import LLMEngine
    from tierserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, min_tokens=args.min_tokens,
                            stop=args.stop, seed=args.request_seed, ignore_eos=args.ignore_eos)
    print(f"loading {args.model or 'SmolLM2-135M-Instruct (default)'} ...", file=sys.stderr)
    if args.priority_step_time_s is None:
        args.priority_step_time_s = 0  # one request: no step-time cap, no calibration
    engine = LLMEngine(engine_config_from_args(args))
    prompt = args.prompt
    if args.chat:
        if engine.tokenizer is None:
            raise TierserveError("--chat needs a tokenizer (dummy weights have none)")
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    engine.add_request("cli", prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
            final = out
    sys.stdout.write("\n")
    if final is not None:
        m = final.metrics
        print(f"[{m.num_output_tokens} tokens, finish_reason={final.outputs[0].finish_reason}, "
              f"ttft={m.ttft_s * 1000:.0f} ms, total={m.e2e_s:.2f} s]", file=sys.stderr)
    return 0


def cmd_bench_tiers(args) -> int:
    if args.two_tenants:
        from tierserve.bench.fairness import run
    else:
        from tierserve.bench.tiers import run
    run(args)
    return 0


def cmd_bill(args) -> int:
    import os

    from tierserve.db import is_postgres
    from tierserve.metering.bill_html import run

    if not is_postgres(args.ledger) and not os.path.exists(args.ledger):
        raise TierserveError(f"no ledger at {args.ledger} (serve writes one; --ledger PATH)")
    return run(args)


def cmd_calibrate(args) -> int:
    if args.backend:
        return _calibrate_backend(args)
    if args.from_steps:
        raise TierserveError("--from-steps reads a running replica's step records: give its "
                             "--backend URL")
    from tierserve.engine.calibrate import calibrate
    from tierserve.engine.llm_engine import LLMEngine

    args.priority_step_time_s = 0  # the engine must not calibrate itself first
    say = (lambda line: print(line, file=sys.stderr))
    engine = LLMEngine(engine_config_from_args(args), progress=say)
    if args.for_serve:
        from tierserve.engine.calibrate import cache_path, calibrate_cached
        model = calibrate_cached(engine, say)
        print(f"a lone decode step {model.predict_s([(1, 256)]) * 1e3:.1f} ms; "
              f"`tierserve serve` with these engine flags reads {cache_path(engine)}")
        return 0
    model = calibrate(engine, repeats=_repeats(args), whole_step=args.whole_step)
    model.save(args.out, model=args.model or "SmolLM2-135M-Instruct", dtype=args.dtype,
               device=args.device, max_num_batched_tokens=args.max_num_batched_tokens)
    print(f"{model.summary()}; wrote {args.out}")
    return 0


CALIBRATE_REPEATS = 2
"""Runs of the calibration grid where `--repeats` is not given."""


def _repeats(args) -> int:
    return CALIBRATE_REPEATS if args.repeats is None else args.repeats


def _calibrate_backend(args) -> int:
    """`calibrate --backend URL`: a running replica timed through its API (no engine
    here, so engine flags would mean nothing: refused)."""
    from tierserve.engine_args import explicit
    from tierserve.router.calibrate import calibrate_backend, calibrate_from_steps

    given = sorted(explicit(args) - {"model"})
    if given or args.for_serve or args.whole_step:
        bad = given[0].replace("_", "-") if given else \
            ("for-serve" if args.for_serve else "whole-step")
        raise TierserveError(f"--{bad} describes an engine run here; with --backend the "
                             "replica is timed as it runs (only --model, --out, --repeats, "
                             "--from-steps)")
    if args.from_steps and args.repeats is not None:
        raise TierserveError("--repeats runs the timing grid again; --from-steps sends no "
                             "grid (it fits the steps the replica recorded)")
    say = (lambda line: print(line, file=sys.stderr))
    if args.from_steps:
        model, info = calibrate_from_steps(args.backend, args.model, say)
        source = "the replica's own step records (tierserve calibrate --backend --from-steps)"
    else:
        model, info = calibrate_backend(args.backend, args.model, _repeats(args), say)
        source = "streamed timings (tierserve calibrate --backend)"
    way = info.get("way_in_s")   # --from-steps' probes, where they could tell
    model.save(args.out, backend=info["url"], model=info["model"], kind=info["kind"],
               source=source, records=info["records"], median_error=round(
                   info["median_error"], 4), **({} if way is None else {"way_in_s": way}))
    print(f"{model.summary()}; median error on its {info['records']} records "
          f"{info['median_error']:.1%}{'' if way is None else f'; the way in {way * 1e3:.1f} ms'}"
          f"; wrote {args.out}")
    return 0


def cmd_bench_throughput(args) -> int:
    from tierserve.bench.throughput import run

    run(args)
    return 0


def cmd_serve(args) -> int:
    from tierserve.server.serve import serve

    return serve(args)


def cmd_epp(args) -> int:
    from tierserve.epp.run import run

    return run(args)


def cmd_bench_serve(args) -> int:
    from tierserve.bench.serve import run

    run(args)
    return 0


def add_serve_flags(srv) -> None:
    """The flags of `tierserve serve` (the endpoint picker takes them all too)."""
    srv.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                     help="model to serve (same as --model)")
    # Every serve flag is a Remember action: a flag given wins over the YAML config.
    arg = functools.partial(srv.add_argument, action=Remember)
    arg("--host", default="127.0.0.1",
        help="listen address (default 127.0.0.1; other addresses need api_keys)")
    arg("--port", type=int, default=8000, help="TCP port (default 8000)")
    srv.add_argument("--config", default=None,
                     help="YAML file; its keys mirror these flags (max_num_seqs: 32), plus "
                          "api_keys, admin_key, strict_tiers, queue_limits, slo, prices, "
                          "budgets, rate_limits, max_file_bytes, max_batch_lines, backends, "
                          "fleet; flags given win")
    arg("--served-model-name", default=None,
        help="name clients send as `model` (default: from the model file)")
    arg("--api-key", default=None, metavar="KEY",
        help="a key every request must bring (Authorization: Bearer KEY; 401 without), "
             "beside the keys of the YAML's api_keys; its tenant is `api-key` "
             "(default: $TIERSERVE_API_KEY)")
    arg("--disable-uvicorn-access-log", const=True, default=False,
        help="no line per HTTP request on stdout")
    arg("--disable-fastapi-docs", const=True, default=False,
        help="serve no /docs, /redoc or /openapi.json")
    from tierserve.metering.ledger import default_path
    from tierserve.metering.prices import MACHINE_PRICE_PER_HOUR
    m = srv.add_argument_group("metering")
    marg = functools.partial(m.add_argument, action=Remember)
    marg("--ledger", default=str(default_path()),
         help="SQLite ledger of every request's cost (default: %(default)s)")
    marg("--no-ledger", dest="ledger", const=None,
         help="keep no ledger (costs still reach responses and /metrics)")
    marg("--database", default=None, metavar="postgresql://...",
         help="PostgreSQL database for the ledger and the batch queue, which several "
              "gateways can share (instead of the SQLite files of --ledger and --data-dir)")
    marg("--hardware", default="cpu-local", choices=list(MACHINE_PRICE_PER_HOUR),
         help="machine price profile for cost (default cpu-local)")
    marg("--machine-price-per-hour", type=float, default=None,
         help="USD per hour of one engine's machine, overriding --hardware")
    b = srv.add_argument_group("batch jobs (/v1/files, /v1/batches)")
    barg = functools.partial(b.add_argument, action=Remember)
    barg("--data-dir", default=str(default_path().parent),
         help="uploaded files, results and the batch queue (default: %(default)s)")
    barg("--no-batches", dest="data_dir", const=None,
         help="serve no /v1/files or /v1/batches")
    barg("--batch-max-in-flight", type=int, default=None,
         help="batch lines in the engine at once (default: 2x --max-num-seqs)")
    f = srv.add_argument_group("fleet mode (tierserve in front of replicas)")
    f.add_argument("--backend", action="append", default=None, metavar="URL",
                   help="an OpenAI-compatible replica (vLLM started with "
                        "--scheduling-policy priority, another tierserve, ...); repeatable. "
                        "With backends no model is loaded here: tiers, routing, cost and "
                        "batch jobs run in front of them. YAML `backends:` gives each its "
                        "kind, models, api_key, price_per_hour or hardware, max_num_seqs; "
                        "`fleet:` tunes the flow control")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tierserve",
        description="LLM inference with explicit service tiers and per-request machine cost.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt as a user message in the model's chat template")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_flags(srv)
    add_engine_args(srv)
    srv.set_defaults(func=cmd_serve)

    epp = sub.add_parser(
        "epp", help="endpoint picker for Envoy (ext_proc): tiers, routing and cost for a "
                    "gateway you already run",
        description="A fleet gateway (every flag of `tierserve serve`; --backend or YAML "
                    "backends: required) that Envoy calls over ext_proc to pick each "
                    "request's replica (the Gateway API Inference Extension's protocol), "
                    "beside its HTTP port (/metrics, /v1/spend, the dashboard, batches).")
    add_serve_flags(epp)
    e = epp.add_argument_group("endpoint picker")
    e.add_argument("--grpc-port", type=int, default=9002,
                   help="ext_proc and gRPC health checking port (default 9002)")
    e.add_argument("--print-envoy-config", action="store_true",
                   help="print an Envoy bootstrap (YAML) for these replicas and this picker, "
                        "and exit")
    e.add_argument("--envoy-port", type=int, default=8081,
                   help="the printed config's listener port (default 8081)")
    e.add_argument("--envoy-admin-port", type=int, default=None,
                   help="the printed config's admin port (default: no admin listener)")
    e.add_argument("--fail-open", action="store_true",
                   help="in the printed config: while the picker is down, Envoy sends "
                        "requests round-robin (untiered, unmetered); default: fail closed "
                        "(500)")
    add_engine_args(epp)
    epp.set_defaults(func=cmd_epp)

    bill = sub.add_parser("bill", help="the bill explained, from the ledger")
    from tierserve.metering.ledger import default_path as ledger_path
    bill.add_argument("--ledger", default=str(ledger_path()),
                      help="SQLite ledger, or a postgresql:// URL (default: %(default)s)")
    bill.add_argument("--since", default=None,
                      help="from this time: ISO date/time (UTC), unix seconds, or an age (24h)")
    bill.add_argument("--until", default=None, help="up to this time (same forms)")
    bill.add_argument("--by", default="tier",
                      help="group by tenant, tier (default), model, size, route (hybrid "
                           "serving's alias/rule), or tag:KEY")
    bill.add_argument("--large", default=None, metavar="MODEL",
                      help="with --by route: compare each route with this model in the "
                           "priority tier (default: the ledger's most expensive per token)")
    bill.add_argument("--format", default="table", choices=["table", "json", "csv"])
    bill.add_argument("--plot", default=None, metavar="OUT.png",
                      help="also draw cost per 1K output tokens of each --by group, and the "
                           "cost split (needs matplotlib)")
    bill.add_argument("--html", default=None, metavar="OUT.html",
                      help="also write the bill, its findings and its plots as one "
                           "self-contained HTML page (no external requests)")
    bill.set_defaults(func=cmd_bill)
    from tierserve.forecast.cli import add_parser as add_forecast_parser
    add_forecast_parser(sub)

    from tierserve.sim.cli import add_parsers as add_sim_parsers
    add_sim_parsers(sub)
    from tierserve.batch.cli import add_parsers as add_batch_parsers
    add_batch_parsers(sub)
    from tierserve.route.cli import add_parsers as add_route_parsers
    add_route_parsers(sub)

    cal = sub.add_parser("calibrate", help="measure this engine's step times and save the "
                                           "fitted step-time model (JSON)")
    cal.add_argument("--out", default="step_time.json", help="file to write "
                                                             "(default step_time.json)")
    cal.add_argument("--repeats", type=int, default=None,
                     help="runs of the calibration grid (default 2)")
    cal.add_argument("--for-serve", action="store_true",
                     help="fill the cache `tierserve serve` reads with the same engine flags "
                          "(~/.cache/tierserve; `make install` does this for the defaults) "
                          "instead of writing --out; kept if already there")
    cal.add_argument("--whole-step", action="store_true",
                     help="time whole engine steps (scheduling and outputs too), for "
                          "`tierserve sim --step-time-profile`, scaled to the grid's mean "
                          "step; default: the forward pass, as the engine's step-time cap "
                          "uses")
    cal.add_argument("--backend", metavar="URL", default=None,
                     help="time a running replica (vLLM or tierserve) through its API "
                          "instead of an engine here: streamed prefills and decode batches, "
                          "fitted as a whole-step model for `tierserve sim`; --model names "
                          "the model to ask for (default: the replica's first)")
    cal.add_argument("--from-steps", action="store_true",
                     help="with --backend: no timing grid; fit the steps a tierserve "
                          "replica (or vLLM with tierserve's plugin) recorded while it "
                          "served its traffic (GET /tierserve/v1/steps; a step timed from "
                          "the end of a busy one before, so the server's turn between "
                          "steps is in it), prompt chunks beside decodes included; then 8 "
                          "one-token probes measure the way in (the profile's way_in_s)")
    add_engine_args(cal)
    cal.set_defaults(func=cmd_calibrate)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    thr = bench_sub.add_parser("throughput", help="offline throughput at several concurrencies, "
                                                  "beside transformers generate")
    from tierserve.bench.throughput import add_args
    add_args(thr)
    add_engine_args(thr)
    thr.set_defaults(func=cmd_bench_throughput)
    bsrv = bench_sub.add_parser("serve", help="streaming HTTP load against tierserve serve, "
                                              "beside the offline engine")
    from tierserve.bench.serve import add_args as add_serve_args
    add_serve_args(bsrv)
    add_engine_args(bsrv)
    bsrv.set_defaults(func=cmd_bench_serve)
    btier = bench_sub.add_parser("tiers", help="tiers under open-loop load: fcfs, strict "
                                               "priority, tiered shared, dedicated silos")
    from tierserve.bench.tiers import add_args as add_tier_args
    add_tier_args(btier)
    from tierserve.bench.fairness import add_args as add_fairness_args
    add_fairness_args(btier)
    btier.set_defaults(func=cmd_bench_tiers)
    from tierserve.bench import metering as bench_metering
    bmet = bench_sub.add_parser("metering", help="engine tok/s with metering and ledger on "
                                                 "vs off, in alternating rounds")
    bench_metering.add_args(bmet)
    bmet.set_defaults(func=lambda a: bench_metering.run_overhead(a) or 0)
    bfast = bench_sub.add_parser("fastmode", help="cost per 1K output tokens: all priority in "
                                                  "dedicated fast mode vs batched vs a mix")
    bench_metering.add_args(bfast)
    bfast.set_defaults(func=lambda a: bench_metering.run_fastmode(a) or 0)
    from tierserve.bench import batch as bench_batch
    bbat = bench_sub.add_parser("batch", help="batch throughput in idle capacity vs the offline "
                                              "engine; priority TTFT with and without a batch")
    bench_batch.add_args(bbat)
    add_engine_args(bbat)
    bbat.set_defaults(func=lambda a: bench_batch.run(a) or 0)
    from tierserve.bench import fleet as bench_fleet
    bflt = bench_sub.add_parser("fleet", help="fleet mode: the gateway in front of real vLLM "
                                              "and tierserve replicas, beside them alone")
    bench_fleet.add_args(bflt)
    bflt.set_defaults(func=lambda a: bench_fleet.run(a) or 0)
    from tierserve.bench import sim_accuracy
    bacc = bench_sub.add_parser("sim-accuracy", help="the simulator against the real engine "
                                                     "on held-out open-loop workloads")
    sim_accuracy.add_args(bacc)
    bacc.set_defaults(func=lambda a: sim_accuracy.run(a) or 0)
    return parser


def check_plot_extra(args) -> None:
    """`--plot` (bill, sim) draws with matplotlib, which only the `plot` extra installs:
    say so before any work is done."""
    if getattr(args, "plot", None) is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise TierserveError("--plot needs matplotlib: pip install 'tierserve[plot]'") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_plot_extra(args)
        return args.func(args)
    except TierserveError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
