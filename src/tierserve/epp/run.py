"""`tierserve epp`: `tierserve serve`'s fleet gateway with the ext_proc service beside its
HTTP port, or (--print-envoy-config) the Envoy bootstrap that goes with it."""

from tierserve.errors import ConfigError


def print_envoy_config(args, settings) -> int:
    from tierserve.epp.envoy import bootstrap, dump
    from tierserve.epp.service import address

    endpoints = [address(s.url) for s in settings.backends]
    admin = (settings.host, args.envoy_admin_port) if args.envoy_admin_port else None
    print(dump(bootstrap(endpoints, (settings.host, args.envoy_port),
                         (settings.host, args.grpc_port), admin, args.fail_open)), end="")
    return 0


def run(args) -> int:
    from tierserve.epp.handoff import Handoff
    from tierserve.server.serve import build, serve

    built = build(args)
    settings = built[0]
    if not settings.backends:
        raise ConfigError("tierserve epp needs the replicas it picks among: --backend URL "
                          "(repeatable) or YAML backends:")
    if len(settings.pools) > 1:  # one InferencePool, one model (the extension's shape)
        raise ConfigError(f"tierserve epp picks within one pool, and these replicas serve "
                          f"{len(settings.pools)} models ({', '.join(settings.pools)}): run "
                          "one endpoint picker per model, as an InferencePool per model")
    if args.print_envoy_config:
        return print_envoy_config(args, settings)
    handoff = Handoff()

    async def started(state, backend):
        from tierserve.epp import service

        stop = await service.start(state, backend, handoff, settings.host, args.grpc_port)
        return f"; endpoint picker (ext_proc) on {settings.host}:{args.grpc_port}", stop

    return serve(args, built, handoff, started)
