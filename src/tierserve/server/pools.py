"""What a server answers to beyond its main model: fleet mode's pools (replicas grouped by
the model they serve, with YAML `pools:` options), aliases (YAML `aliases:` and a
replica's further names) and fallbacks (YAML `fallbacks:`), parsed and checked at start.
"""

from tierserve.errors import ConfigError
from tierserve.server.settings import POOL_OPTIONS


def group_pools(settings, extra: dict, main: str) -> None:
    """Fleet mode's pools: the replicas grouped by the model they serve (their first
    name; one that names none serves the main model). The first replica's pool is the
    main model (`--served-model-name` renames it). A replica's further names are aliases
    of its pool. YAML `pools:` gives a pool its own options."""
    first = (settings.backends[0].models or [main])[0]
    pools: dict[str, list] = {}
    for spec in settings.backends:
        key = (spec.models or [first])[0]
        pools.setdefault(main if key == first else key, []).append(spec)
    for name, specs in pools.items():
        for spec in specs:
            for other in spec.models[1:]:
                if other not in pools and other != name:
                    settings.aliases.setdefault(other, name)
    options = extra.get("pools") or {}
    if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
        raise ConfigError("pools: expected MODEL -> {step_time_profile: PATH, tokenizer: "
                          "PATH, priority_ttft_s: S, priority_tpot_s: S}")
    for name, opts in options.items():
        if name not in pools:
            raise ConfigError(f"pools: no replica serves {name!r}; the pools are "
                              f"{', '.join(pools)}")
        unknown = set(opts) - set(POOL_OPTIONS)
        if unknown:
            raise ConfigError(f"pools.{name}: unknown key {sorted(unknown)[0]!r} (one of "
                              f"{', '.join(POOL_OPTIONS)})")
        for key in ("priority_ttft_s", "priority_tpot_s"):
            v = opts.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or v <= 0):
                raise ConfigError(f"pools.{name}.{key} must be a number > 0, got {v!r}")
    settings.pools = pools
    settings.pool_options = {str(k): dict(v) for k, v in options.items()}


def add_aliases(settings, raw, served: set) -> None:
    """YAML `aliases: {ALIAS: MODEL}` on top of the replicas' own further names."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
        raise ConfigError("aliases: expected ALIAS -> MODEL (a served model's name)")
    for alias, model in raw.items():
        alias = str(alias)
        if model not in served:
            raise ConfigError(f"aliases.{alias}: {model!r} is not a served model (one of "
                              f"{', '.join(sorted(served))})")
        if alias in served or alias in settings.routes:
            raise ConfigError(f"aliases.{alias}: {alias!r} is a model or route already")
        settings.aliases[alias] = model
    for alias in [a for a in settings.aliases if a in settings.routes]:
        del settings.aliases[alias]  # a route of that name wins over a replica's name


def parse_fallbacks(raw, served: set, aliases: dict) -> dict[str, list[str]]:
    """YAML `fallbacks: {MODEL: OTHER}` or `{MODEL: [OTHER, ...]}` (tried in order)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError("fallbacks: expected MODEL -> OTHER or [OTHER, ...]")
    out = {}
    for model, others in raw.items():
        model = aliases.get(str(model), str(model))
        others = [others] if isinstance(others, str) else others
        if not isinstance(others, list) or not others or \
                not all(isinstance(o, str) for o in others):
            raise ConfigError(f"fallbacks.{model}: expected a model name or a list of them")
        others = [aliases.get(o, o) for o in others]
        for name in (model, *others):
            if name not in served:
                raise ConfigError(f"fallbacks: {name!r} is not a served model (one of "
                                  f"{', '.join(sorted(served))})")
        if model in others:
            raise ConfigError(f"fallbacks.{model}: a model cannot fall back to itself")
        out[model] = others
    return out
