"""`tierserve serve`: settings from flags and YAML, listen at once, load the model, serve.

The server listens while the model loads (`/health` answers 503 "loading" until then),
so orchestrators can tell "starting" from "dead".
"""

import asyncio
import concurrent.futures
import gc
import os
import sys

from tierserve.errors import ConfigError, TierserveError

DEFAULT_CPU_PROFILE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "hardware",
                                   "profiles", "cpu", "smollm2-135m.json")
"""`tierserve calibrate` (the forward pass, as the engine meters by) of SmolLM2-135M on the
2-core epyc-2c machine: how fleet mode splits a CPU replica's cost when no
--step-time-profile is given."""

_SETTINGS_ONLY = {"api_keys", "strict_tiers", "queue_limits", "max_body_bytes", "max_n",
                  "slo", "prices", "budgets", "rate_limits", "admin_key", "max_file_bytes", "max_batch_lines", "fleet",
                  "backends", "models", "routes", "route_classifier", "schedule", "pools",
                  "aliases", "fallbacks"}


def load_yaml(path: str) -> dict:
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings")
    return data


def merge_config(args, data: dict) -> dict:
    """Copy YAML values onto args wherever the command line did not give the setting."""
    from tierserve.engine_args import explicit

    given = explicit(args)
    extra = {}
    for key, value in data.items():
        key = key.replace("-", "_")
        if key in _SETTINGS_ONLY:
            extra[key] = value
        elif key == "model" or hasattr(args, key):
            if key not in given:
                setattr(args, key, value)
        else:
            raise ConfigError(f"unknown setting {key!r} in the config file")
    return extra


def default_model_name(model: str | None, load_format: str) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    if load_format == "dummy":
        return model
    name = os.path.basename(os.path.normpath(model))
    return name[:-5] if name.endswith(".gguf") else name


def api_key(args) -> str | None:
    """--api-key given on the command line, else $TIERSERVE_API_KEY, else the YAML's
    `api_key` (the environment beats the file, as for admin_key)."""
    from tierserve.engine_args import explicit

    if "api_key" in explicit(args):
        return args.api_key
    return os.environ.get("TIERSERVE_API_KEY") or args.api_key


def build(args):
    from tierserve.engine_args import engine_config_from_args, mark_explicit
    from tierserve.server.settings import ServerSettings

    if args.model_pos is not None:
        args.model = args.model_pos
        mark_explicit(args, "model")
    extra = merge_config(args, load_yaml(args.config)) if args.config else {}
    settings = ServerSettings(
        host=args.host, port=args.port, served_model_name=args.served_model_name,
        api_keys=ServerSettings.parse_api_keys(extra.get("api_keys", {}), api_key(args)),
        strict_tiers=bool(extra.get("strict_tiers", False)), ledger=args.ledger,
        database=args.database,
        hardware=args.hardware, machine_price_per_hour=args.machine_price_per_hour,
        prices=ServerSettings.parse_prices(extra.get("prices", {})),
        budgets=ServerSettings.parse_budgets(extra.get("budgets", {})),
        rate_limits=ServerSettings.parse_rate_limits(extra.get("rate_limits", {})),
        admin_key=os.environ.get("TIERSERVE_ADMIN_KEY") or extra.get("admin_key"),
        data_dir=args.data_dir, batch_max_in_flight=args.batch_max_in_flight,
        backends=ServerSettings.parse_backends(args.backend or extra.get("backends", [])),
        fleet=ServerSettings.parse_fleet(extra.get("fleet", {})),
        health_interval_s=ServerSettings.parse_health_interval(extra.get("fleet", {})),
        disable_fastapi_docs=bool(args.disable_fastapi_docs))
    if "queue_limits" in extra:
        settings.queue_limits.update(extra["queue_limits"])
    for key in ("max_body_bytes", "max_n", "max_file_bytes", "max_batch_lines"):
        if key in extra:
            setattr(settings, key, int(extra[key]))
    settings.validate()
    if settings.backends:  # what the replicas serve and are, where the config is silent
        from tierserve.router.remote import discover

        for spec in settings.backends:
            print(f"tierserve: {discover(spec)}", file=sys.stderr, flush=True)
    config = engine_config_from_args(args)
    if settings.backends and config.speculative is not None:
        raise ConfigError("--speculative-config applies to the in-process engine; a fleet's "
                          "replicas speculate by their own flags (vLLM's --speculative-config)")
    if "slo" in extra:
        from tierserve.llm import parse_slo
        config.tiers.slo = parse_slo(extra["slo"])
    config.validate()
    name = settings.served_model_name or (
        settings.backends[0].models[0] if settings.backends and settings.backends[0].models
        else default_model_name(args.model, args.load_format))
    if settings.backends:
        from tierserve.server.pools import group_pools
        group_pools(settings, extra, name)
    add_models(settings, extra, name)
    if extra.get("schedule") is not None:
        from tierserve.schedule import parse_schedule
        raw = extra["schedule"]  # the mapping itself, or the file plan --forecast wrote
        settings.schedule = parse_schedule(load_yaml(raw) if isinstance(raw, str) else raw)
    return settings, config, name


def add_models(settings, extra: dict, main: str) -> None:
    """YAML `models:` (more in-process models), `routes:` and `route_classifier:`."""
    from tierserve.route.rules import parse_routes
    from tierserve.server.pools import add_aliases, parse_fallbacks

    models = extra.get("models") or {}
    if not isinstance(models, dict) or not all(isinstance(v, dict) for v in models.values()):
        raise ConfigError("models: expected name -> {model: PATH, max_num_seqs: N, ...}")
    if main in models:
        raise ConfigError(f"models: {main!r} is the main model's name already")
    if models and settings.backends:
        raise ConfigError("models: more in-process models beside fleet replicas is not "
                          "supported; run a gateway per model")
    settings.models = {str(k): dict(v) for k, v in models.items()}
    served = {main, *settings.models, *settings.pools}
    settings.routes = parse_routes(extra.get("routes"), served)
    settings.route_classifier = extra.get("route_classifier")
    add_aliases(settings, extra.get("aliases"), served)
    settings.fallbacks = parse_fallbacks(extra.get("fallbacks"), served, settings.aliases)


def model_config(config, options: dict):
    """The main engine's config with one more model's options on top."""
    import copy
    import dataclasses

    from tierserve.llm import engine_config

    flat = {}
    for part in (config.model, config.cache, config.scheduler, config.tiers):
        flat.update({f.name: getattr(part, f.name) for f in dataclasses.fields(part)})
    flat.update(options)
    try:
        out = engine_config(**{k: v for k, v in flat.items() if k != "slo"})
    except TypeError as exc:
        raise ConfigError(f"models: {exc}") from None
    out.tiers.slo = copy.deepcopy(config.tiers.slo)
    out.validate()
    return out


def build_fleet(settings, config, name: str, specs: list, say, transport=None):
    """The fleet backend of one pool (`specs`, the replicas serving model `name`): the
    gateway's flow control for it (its SLO signal is the priority tier's), a step-time
    model to split each replica's cost (a calibrated profile, the shipped CPU profile, or
    a GPU roofline of the model's shape) and a tokenizer to count prompt tokens; YAML
    `pools: {name: ...}` gives the pool its own."""
    from dataclasses import replace

    from tierserve.core.step_time import StepTimeModel
    from tierserve.router.fleet import FleetBackend

    mc, tiers = config.model, config.tiers
    opts = settings.pool_options.get(name, {})
    main = name == next(iter(settings.pools))
    profile = opts.get("step_time_profile") or tiers.step_time_profile
    if profile:
        model = StepTimeModel.load(profile)
    elif settings.hardware == "cpu-local":
        model = StepTimeModel.load(DEFAULT_CPU_PROFILE)
    else:
        from tierserve.hardware.roofline import load_hardware, roofline
        from tierserve.model.metadata import default_model_path, resolve

        model = roofline(resolve(mc.model or default_model_path()),
                         load_hardware(settings.hardware))
    slo = tiers.slo.get("priority")
    flow = replace(settings.fleet, flex_max_wait_s=config.scheduler.flex_max_wait_s,
                   priority_ttft_s=opts.get("priority_ttft_s") or settings.fleet.priority_ttft_s
                   or (slo and slo.ttft_s),
                   priority_tpot_s=opts.get("priority_tpot_s") or settings.fleet.priority_tpot_s
                   or (slo and slo.tpot_s))
    tokenizer = None
    named = opts.get("tokenizer") or (mc.tokenizer if main else None)
    source = named or (mc.model if mc.load_format != "dummy" and main else None)
    try:
        from tierserve.model.metadata import default_model_path
        from tierserve.model.tokenizer import Tokenizer

        if source is None and not main:
            raise ValueError(f"none given for {name} (YAML pools: {{{name}: {{tokenizer: "
                             "PATH}}}})")
        tokenizer = Tokenizer.for_gateway(source or default_model_path())
    except Exception as exc:  # counting falls back to an estimate; said once, here
        if named:
            raise ConfigError(f"cannot load the tokenizer {named}: {exc}") from None
        say(f"{name}: no tokenizer ({exc}); prompt tokens are estimated until replicas "
            "report them")
    say(f"fleet mode, {name}: {len(specs)} replica(s) "
        f"({', '.join(f'{s.name}={s.url} ({s.kind})' for s in specs)})")
    return FleetBackend(specs, name, model, flow, tiers.slo, tokenizer,
                        health_interval_s=settings.health_interval_s, transport=transport)


async def build_engines(config, say):
    """The AsyncEngine (shared deployment) or DedicatedEngines (dedicated). Each engine is
    built on the thread that will run its steps (see AsyncEngine's note)."""
    import copy

    from tierserve.engine.async_engine import AsyncEngine
    from tierserve.engine.llm_engine import LLMEngine

    loop = asyncio.get_running_loop()

    async def one(cfg, label: str) -> AsyncEngine:
        thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"engine-{label}")
        engine = await loop.run_in_executor(thread, LLMEngine, cfg, None, None, say)
        return AsyncEngine(engine, executor=thread)

    if config.tiers.deployment == "shared":
        return await one(config, "shared")
    import torch

    from tierserve.router.dedicated import DedicatedEngines

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))  # the cores, split in two
    fast_cfg = copy.deepcopy(config)
    fast_cfg.tiers.deployment = "shared"  # each engine alone is a plain engine
    fast_cfg.scheduler.max_num_seqs = config.tiers.dedicated_max_num_seqs
    fast_cfg.scheduler.policy = "fcfs"
    fast_cfg.scheduler.reserved_priority_seqs = 0
    main_cfg = copy.deepcopy(fast_cfg)
    main_cfg.scheduler = copy.deepcopy(config.scheduler)
    main_cfg.scheduler.priority_step_time_s = 0  # no priority requests reach it
    fast = await one(fast_cfg, "fast")
    say(f"dedicated deployment: a priority engine with max_num_seqs "
        f"{fast_cfg.scheduler.max_num_seqs}, beside one for the other tiers; "
        f"{torch.get_num_threads()} threads each")
    return DedicatedEngines(fast, await one(main_cfg, "main"))


async def build_more(settings, config, say) -> dict:
    """The engines of YAML `models:`, before the main one. The cores are split between
    the engines (as the dedicated deployment does), so a small model's fast lane never
    waits behind a large model's step."""
    if not settings.models:
        return {}
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // (1 + len(settings.models))))
    out = {}
    for name, options in settings.models.items():
        cfg = model_config(config, options)
        cfg.tiers.deployment = "shared"
        say(f"loading {name} ({options.get('model') or 'the default model'}), "
            f"{torch.get_num_threads()} thread(s)")
        out[name] = await build_engines(cfg, say)
    return out


def uvicorn_config(app, settings, access_log: bool):
    """uvicorn's settings: its own messages from warnings up, and (unless turned off) one
    access line per request on stdout, as vLLM prints them."""
    import logging

    import uvicorn

    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                            lifespan="on", access_log=access_log)
    if access_log:  # uvicorn writes access lines at INFO, below the warning level above
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    return config


def serve(args, built=None, transport=None, started=None) -> int:
    """`built`: build(args)'s result, where the caller read it first; `transport` and
    `started` are the endpoint picker's (epp/run.py): the fleet backend's transport,
    and `await started(state, backend)` once the backend is attached, which returns
    (what to add to the ready line, an async callable that stops what it started)."""
    import uvicorn

    from tierserve.router.local import LocalBackend
    from tierserve.server.app import create_app

    settings, config, name = built or build(args)
    app = create_app(None, settings, name)
    state = app.state.tierserve
    server = uvicorn.Server(uvicorn_config(app, settings, not args.disable_uvicorn_access_log))
    url = f"http://{settings.host}:{settings.port}"
    failure: list[BaseException] = []
    stops: list = []

    def say(line: str) -> None:
        print(f"tierserve: {line}", file=sys.stderr, flush=True)

    async def load() -> None:
        while not server.started:
            await asyncio.sleep(0.05)
        say(f"listening on {url} (loading {name}; /health says 503 until ready)")
        try:
            if settings.backends:
                more = {pool: build_fleet(settings, config, pool, specs, say, transport)
                        for pool, specs in settings.pools.items()}
                # health, which replicas run tierserve's plugin, the fast lane's target
                await asyncio.gather(*(b.probe(say) for b in more.values()))
                backend = more.pop(name)
                what = f"{len(settings.backends)} replica(s) behind the gateway"
                if more:
                    what += f" in {1 + len(more)} pools"
                plugins = [s.name for s in settings.backends if s.plugin]
                if plugins:
                    what += f"; tierserve's vLLM plugin on {', '.join(plugins)}"
                up = [r.name for b in (backend, *more.values()) for r in b.gateway.replicas
                      if r.healthy]
                if not up:
                    what += ("; NOT READY: no replica answered its health check (/health "
                             "says 503 until one does)")
            else:
                more = await build_more(settings, config, say)
                backend = LocalBackend(await build_engines(config, say))
                backend.machine_share = 1 / (1 + len(more))
                what = f"{config.tiers.deployment} deployment, {config.scheduler.policy} policy"
        except Exception as exc:  # report and stop the server
            failure.append(exc)
            server.should_exit = True
            return
        state.attach(backend)
        if started is not None:
            try:
                more_what, stop = await started(state, backend)
            except Exception as exc:
                failure.append(exc)
                server.should_exit = True
                return
            stops.append(stop)
            what += more_what
        for extra, engine in more.items():
            if settings.backends:
                part = engine  # another pool's fleet backend
            else:
                part = LocalBackend(engine, extra)
                part.machine_share = backend.machine_share  # the cores are split evenly
            state.attach(part, extra)
        if more:
            what += f"; also {', '.join(more)}; routes: {', '.join(settings.routes) or 'none'}"
        # What start-up built (weights' modules, tokenizer, calibration: about 0.9 M
        # objects) stays alive: moved out of the collector's view, as vLLM does, so a full
        # collection while serving does not walk it (257 ms here when one did at start-up,
        # 2-core EPYC Zen 4; docs/benchmarks.md). Reference counting still frees them.
        gc.collect()
        gc.freeze()
        word = "started" if "NOT READY" in what else "ready"
        say(f"{word}: serving {name} at {url}/v1 ({what})")

    async def main() -> None:
        task = asyncio.create_task(load())
        await server.serve()
        task.cancel()
        for stop in stops:
            await stop()

    asyncio.run(main())
    if failure:
        exc = failure[0]
        if isinstance(exc, TierserveError):
            raise exc
        raise TierserveError(f"model failed to load: {exc}") from exc
    return 0
