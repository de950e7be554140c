"""Server settings: listen address, tenants and their keys, tier admission limits.

Loaded from flags and from a YAML file whose keys mirror the flags (`--max-num-seqs` is
`max_num_seqs:`); tenants and queue limits are YAML-only structures:

    api_keys:
      sk-team-a: {tenant: team-a, tiers: [priority, default, flex], weight: 2}
      sk-batchy: {tenant: analytics, tiers: [flex, batch], cache_group: shared}
    rate_limits: {team-a: {requests_per_minute: 600, tokens_per_minute: 200000}}
    strict_tiers: false
    queue_limits: {priority: 16, default: 128, flex: 256}

`--api-key KEY` (or $TIERSERVE_API_KEY) adds one key, of the tenant `api-key`, to those of
`api_keys`; as with any key, requests without a known key then get 401. VLLM_API_KEY is
not read: a gateway in front of vLLM replicas may have it set as the replicas' key, which
would then lock its own clients out.
"""

import ipaddress
from dataclasses import dataclass, field

from tierserve.core.request import Owner
from tierserve.errors import ConfigError, InvalidRequestError
from tierserve.metering.prices import PriceList, machine_price
from tierserve.metering.recorder import Budget
from tierserve.router.flow import FlowConfig
from tierserve.router.remote import ReplicaSpec
from tierserve.server.limits import RateLimit
from tierserve.tiers import TIER_NAMES, Tier

TIERS = TIER_NAMES
POOL_OPTIONS = ("step_time_profile", "tokenizer", "priority_ttft_s", "priority_tpot_s")
"""What YAML `pools:` may set per model (fleet mode)."""
API_KEY_TENANT = "api-key"
"""Tenant of the key of --api-key: every tier, weight 1, its own prefix cache."""


@dataclass
class Tenant:
    name: str
    """Who is billed; appears in logs and, later, in the ledger."""
    tiers: list[str] = field(default_factory=lambda: list(TIERS))
    """Tiers this tenant's key may use (`batch`: the /v1/batches API)."""
    weight: float = 1.0
    """Share of a tier against the other tenants in it (fair queuing by tokens)."""
    cache_group: str | None = None
    """Tenants of one named group share cached prompt prefixes; None: the tenant's own
    cache, which no other tenant's request can hit."""

    @property
    def allowed(self) -> frozenset[Tier]:
        """The tiers of `tiers`, parsed (tiers.resolve picks among them)."""
        return frozenset(Tier.parse(t) for t in self.tiers)

    def owner(self, cache_salt: str | None = None) -> Owner:
        """The engine's view of a request of this tenant (`cache_salt`: the request's)."""
        salt = self.cache_group or f"tenant:{self.name}"
        return Owner(self.name, self.weight,
                     salt if cache_salt is None else f"{salt}\x00{cache_salt}")


OPEN_TENANT = Tenant("anonymous")

OBJECTIVE_HEADER = "x-gateway-inference-objective"
"""The Inference Extension's objective header; here it names a tier."""
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
"""The Inference Extension's fairness id; here the tenant, where no API keys name one."""
OBJECTIVES = ("auto", "default", "flex", "priority")


def gie_tier(headers) -> str | None:
    """The tier an Inference Extension gateway asked for in its objective header (None:
    none asked; the body's `service_tier` wins where both are given)."""
    value = headers.get(OBJECTIVE_HEADER)
    if not value:
        return None
    if value not in OBJECTIVES:
        raise InvalidRequestError(
            f"{OBJECTIVE_HEADER}: {value!r} is not a tier this server knows; use one of "
            f"{', '.join(OBJECTIVES)}", param=OBJECTIVE_HEADER, code="invalid_value")
    return value


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    """Address to listen on. Without api_keys only loopback addresses are allowed."""
    port: int = 8000
    """TCP port."""
    served_model_name: str | None = None
    """Name clients put in `model`; default: derived from the model file or preset."""
    api_keys: dict[str, Tenant] = field(default_factory=dict)
    """Bearer key -> tenant. Empty means open mode (loopback only)."""
    strict_tiers: bool = False
    """Refuse (403) a tier the key may not use, instead of serving the nearest allowed one."""
    queue_limits: dict[str, int] = field(default_factory=lambda: {
        "priority": 32, "default": 256, "flex": 256, "batch": 1024})
    """Most requests per tier accepted but not yet producing tokens; beyond: 429."""
    max_body_bytes: int = 4 * 2**20
    """Largest request body; beyond: 413."""
    max_n: int = 8
    """Largest `n` (choices per request)."""
    ledger: str | None = None
    """SQLite ledger path; None: no ledger (the CLI defaults to the user's data dir)."""
    database: str | None = None
    """A postgresql:// URL: the ledger and the batch queue live there (several gateways
    share them) instead of in SQLite files."""
    hardware: str = "cpu-local"
    """Machine price profile (metering.prices.MACHINE_PRICE_PER_HOUR)."""
    machine_price_per_hour: float | None = None
    """Overrides the hardware profile's price (USD per hour, per engine)."""
    prices: PriceList = field(default_factory=PriceList)
    """What tenants are charged per million tokens, with tier multipliers."""
    budgets: dict[str, Budget] = field(default_factory=dict)
    """Tenant name -> budget. A request reserves its worst-case charge when admitted;
    once spent plus reserved reaches the budget, new requests get 429 insufficient_quota."""
    admin_key: str | None = None
    """Bearer key of the admin API (/admin/v1/...); None: the admin API is off. Setting it
    also ends open mode: every request then needs a key."""
    rate_limits: dict[str, RateLimit] = field(default_factory=dict)
    """Tenant name -> requests and tokens per minute (429 rate_limit_exceeded beyond)."""
    data_dir: str | None = None
    """Where uploaded files, batch results and the batch queue (SQLite) live; None: no
    /v1/files or /v1/batches (the CLI defaults to the user's data dir)."""
    max_file_bytes: int = 200 * 2**20
    """Largest uploaded file; beyond: 413."""
    max_batch_lines: int = 50_000
    """Most requests in one batch file; beyond: 400."""
    batch_max_in_flight: int | None = None
    """Batch lines in the engine at once; None: twice max_num_seqs."""
    backends: list = field(default_factory=list)
    """Fleet mode: remote replicas (router.remote.ReplicaSpec); empty: the in-process
    engine."""
    fleet: FlowConfig = field(default_factory=FlowConfig)
    health_interval_s: float = 2.0
    """Fleet mode: seconds between health checks of each replica (YAML `fleet:
    {health_interval_s: N}`)."""
    """Fleet mode's flow control (router.flow.FlowConfig)."""
    disable_fastapi_docs: bool = False
    """Serve no /docs, /redoc or /openapi.json."""
    models: dict[str, dict] = field(default_factory=dict)
    """More in-process models served beside the main one: name -> engine options
    (`model`, `max_num_seqs`, `dtype`, `load_format`, ...; the rest from the main one)."""
    routes: dict = field(default_factory=dict)
    """Model aliases clients call -> route.rules.Route (the YAML's `routes:`)."""
    pools: dict[str, list[ReplicaSpec]] = field(default_factory=dict)
    """Fleet mode: served model -> the replicas serving it (grouped by each replica's
    first model name; the first pool is the main model)."""
    pool_options: dict[str, dict] = field(default_factory=dict)
    """Fleet mode, YAML `pools: {MODEL: {...}}`: a pool's own step-time profile,
    tokenizer and priority targets (POOL_OPTIONS)."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Other names clients may call a served model by -> that model (YAML `aliases:`, and a
    replica's further names)."""
    fallbacks: dict[str, list[str]] = field(default_factory=dict)
    """Served model -> the models tried in order when its pool has no healthy replica or
    its tier's queue is full (YAML `fallbacks:`)."""
    route_classifier: str | None = None
    """The trained router (`tierserve route train`) that `score_min` rules use."""
    schedule: object = None
    """schedule.Schedule applied live (server/capacity.py); None: static all day."""

    @property
    def ledger_target(self) -> str | None:
        """Where the ledger is written: the database if given, else the SQLite file."""
        return self.database or self.ledger

    @property
    def price_per_hour(self) -> float:
        return machine_price(self.hardware, self.machine_price_per_hour)

    def validate(self) -> None:
        if self.database is not None and not self.database.startswith(("postgresql://",
                                                                        "postgres://")):
            raise ConfigError(f"database must be a postgresql:// URL, got {self.database!r}")
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must be in 1..65535, got {self.port}")
        if self.admin_key is not None and len(self.admin_key) < 16:
            raise ConfigError("admin_key must have at least 16 characters")
        if not self.api_keys and self.admin_key is None and not _is_loopback(self.host):
            raise ConfigError(f"refusing to serve {self.host} without api_keys: open mode "
                              "is for loopback addresses only")
        for key, tenant in self.api_keys.items():
            bad = [t for t in tenant.tiers if t not in TIERS]
            if bad or not tenant.tiers:
                raise ConfigError(f"tenant {tenant.name!r}: tiers must be a non-empty subset "
                                  f"of {', '.join(TIERS)}, got {tenant.tiers}")
            if not tenant.weight > 0:
                raise ConfigError(f"tenant {tenant.name!r}: weight must be > 0, "
                                  f"got {tenant.weight}")
        for tier, limit in self.queue_limits.items():
            if tier not in TIERS or limit < 0:
                raise ConfigError(f"queue_limits: bad entry {tier}: {limit}")
        machine_price(self.hardware, self.machine_price_per_hour)  # ConfigError if unknown
        self.prices.validate()
        for tenant, budget in self.budgets.items():
            budget.validate(tenant)
        if self.max_file_bytes < 1 or self.max_batch_lines < 1 or \
                (self.batch_max_in_flight is not None and self.batch_max_in_flight < 1):
            raise ConfigError("max_file_bytes, max_batch_lines and batch_max_in_flight must "
                              "be positive")

    @staticmethod
    def parse_backends(raw: list) -> list[ReplicaSpec]:
        """`--backend URL` (repeatable) or YAML `backends:` (URLs or mappings)."""
        if not isinstance(raw, list):
            raise ConfigError(f"backends: expected a list, got {raw!r}")
        specs = [ReplicaSpec.parse(item, i) for i, item in enumerate(raw)]
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ConfigError(f"backends: replica names must differ, got {names}")
        return specs

    @staticmethod
    def parse_fleet(raw: dict) -> FlowConfig:
        """YAML `fleet: {reserved_priority_seqs: 4, decrease: 0.7, ...}` (FlowConfig; its
        `health_interval_s` is read by `parse_health_interval`)."""
        if not isinstance(raw, dict):
            raise ConfigError(f"fleet: expected a mapping, got {raw!r}")
        raw = {k: v for k, v in raw.items() if k != "health_interval_s"}
        unknown = set(raw) - set(FlowConfig.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"fleet: unknown key {sorted(unknown)[0]!r}")
        return FlowConfig(**raw)

    @staticmethod
    def parse_health_interval(raw: dict) -> float:
        """YAML `fleet: {health_interval_s: N}`: seconds between replica health checks."""
        value = (raw or {}).get("health_interval_s", 2.0) if isinstance(raw, dict) else 2.0
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"fleet: health_interval_s must be a number > 0, got {value!r}")
        return float(value)

    @staticmethod
    def parse_budgets(raw: dict) -> dict[str, Budget]:
        """YAML `budgets: {team-a: {amount_usd: 50, period: month}}`."""
        out = {}
        for tenant, spec in (raw or {}).items():
            if not isinstance(spec, dict) or "amount_usd" not in spec:
                raise ConfigError(f"budgets.{tenant}: expected {{amount_usd: N, period: "
                                  f"day|month|total}}, got {spec!r}")
            out[str(tenant)] = Budget(float(spec["amount_usd"]), str(spec.get("period", "month")))
        return out

    @staticmethod
    def parse_rate_limits(raw: dict) -> dict[str, RateLimit]:
        """YAML `rate_limits: {team-a: {requests_per_minute: 600, tokens_per_minute: N}}`."""
        if not isinstance(raw or {}, dict):
            raise ConfigError(f"rate_limits: expected a mapping of tenants, got {raw!r}")
        return {str(t): RateLimit.parse(str(t), spec) for t, spec in (raw or {}).items()}

    @staticmethod
    def parse_prices(raw: dict) -> PriceList:
        """YAML `prices: {input_per_m: .., cached_input_per_m: .., output_per_m: ..,
        tier_multipliers: {priority: 2.0, ...}}`."""
        prices = PriceList()
        for key, value in (raw or {}).items():
            if key == "tier_multipliers":
                try:
                    prices.tier_multipliers.update({Tier.parse(str(t)): float(m)
                                                    for t, m in value.items()})
                except ValueError as exc:
                    raise ConfigError(f"prices.tier_multipliers: {exc}") from None
            elif key in ("input_per_m", "cached_input_per_m", "output_per_m"):
                setattr(prices, key, float(value))
            else:
                raise ConfigError(f"prices: unknown key {key!r}")
        return prices

    @staticmethod
    def parse_api_keys(raw: dict, api_key: str | None = None) -> dict[str, Tenant]:
        """YAML `api_keys`, plus `api_key` (--api-key) as a key of API_KEY_TENANT unless
        the YAML already gives that key a tenant."""
        if api_key is not None and not api_key.strip():
            raise ConfigError("--api-key must not be empty")
        keys = {}
        for key, spec in (raw or {}).items():
            if isinstance(spec, str):
                spec = {"tenant": spec}
            if not isinstance(spec, dict) or "tenant" not in spec:
                raise ConfigError(f"api_keys: entry for a key needs a tenant name, got {spec!r}")
            unknown = set(spec) - {"tenant", "tiers", "weight", "cache_group"}
            if unknown:
                raise ConfigError(f"api_keys: unknown field {sorted(unknown)[0]!r} for "
                                  f"tenant {spec['tenant']!r}")
            try:
                weight = float(spec.get("weight", 1.0))
            except (TypeError, ValueError):
                raise ConfigError(f"api_keys: weight of tenant {spec['tenant']!r} must be a "
                                  f"number, got {spec.get('weight')!r}") from None
            group = spec.get("cache_group")
            keys[str(key)] = Tenant(str(spec["tenant"]), list(spec.get("tiers", TIERS)),
                                    weight, None if group is None else str(group))
        if api_key is not None:
            keys.setdefault(api_key, Tenant(API_KEY_TENANT))
        by_name: dict[str, Tenant] = {}
        for tenant in keys.values():  # one tenant's keys must agree on what it shares
            seen = by_name.setdefault(tenant.name, tenant)
            if (seen.weight, seen.cache_group) != (tenant.weight, tenant.cache_group):
                raise ConfigError(f"api_keys: the keys of tenant {tenant.name!r} give "
                                  "different weights or cache groups")
        return keys


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
