"""Tenants and their keys, changed at run time through the admin API and kept in the
ledger's database (SQLite file or PostgreSQL), so they survive restarts.

NOTE: where a tenant comes from
    The YAML's `api_keys`, `budgets` and `rate_limits` are read at startup; tenants and
    keys made through the admin API live in the database (tables `tenants` and
    `api_keys`, in the ledger's migrations) and are loaded over them at startup: for a
    tenant in both, the database's settings win (they are the later change). A key is
    stored only as its SHA-256: the key itself is shown once, when it is made, and
    cannot be read back. Revoking a key takes effect at once on this server; another
    gateway sharing the database sees a new key at once (a key it does not know is looked
    up) and a revocation within `refresh_s`.
"""

import hashlib
import json
import secrets
import threading
import time
from dataclasses import dataclass, field

from tierserve.errors import ConfigError, InvalidRequestError, NotFoundError
from tierserve.metering.recorder import Budget
from tierserve.server.limits import RateLimit
from tierserve.tiers import TIER_NAMES


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass
class TenantSpec:
    """Everything configurable about a tenant (the admin API's body)."""

    tiers: list[str] = field(default_factory=lambda: list(TIER_NAMES))
    weight: float = 1.0
    cache_group: str | None = None
    budget: Budget | None = None
    rate_limit: RateLimit | None = None

    def to_json(self) -> dict:
        return {"tiers": self.tiers, "weight": self.weight, "cache_group": self.cache_group,
                "budget": None if self.budget is None else {
                    "amount_usd": self.budget.amount_usd, "period": self.budget.period},
                "rate_limits": None if self.rate_limit is None else {
                    "requests_per_minute": self.rate_limit.requests_per_minute,
                    "tokens_per_minute": self.rate_limit.tokens_per_minute}}

    @classmethod
    def from_json(cls, name: str, raw: dict, base: "TenantSpec | None" = None) -> "TenantSpec":
        """Parse (and validate) a body; fields it leaves out keep their `base` values;
        `budget` or `rate_limits` set to null remove them."""
        if not isinstance(raw, dict):
            raise InvalidRequestError("expected a JSON object")
        unknown = set(raw) - {"tiers", "weight", "cache_group", "budget", "rate_limits"}
        if unknown:
            raise InvalidRequestError(f"Unrecognized request argument supplied: "
                                      f"{sorted(unknown)[0]}", param=sorted(unknown)[0],
                                      code="unknown_parameter")
        spec = TenantSpec(**vars(base)) if base is not None else TenantSpec()
        try:
            if "tiers" in raw:
                tiers = raw["tiers"]
                if not isinstance(tiers, list) or not tiers or \
                        any(t not in TIER_NAMES for t in tiers):
                    raise ConfigError(f"tiers must be a non-empty list of "
                                      f"{', '.join(TIER_NAMES)}")
                spec.tiers = list(dict.fromkeys(tiers))
            if "weight" in raw:
                w = raw["weight"]
                if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w <= 1e6:
                    raise ConfigError("weight must be a number in (0, 1e6]")
                spec.weight = float(w)
            if "cache_group" in raw:
                g = raw["cache_group"]
                if g is not None and (not isinstance(g, str) or not 0 < len(g) <= 256):
                    raise ConfigError("cache_group must be a string of 1 to 256 characters")
                spec.cache_group = g
            if "budget" in raw:
                b = raw["budget"]
                if b is None:
                    spec.budget = None
                else:
                    if not isinstance(b, dict) or set(b) - {"amount_usd", "period"} or \
                            isinstance(b.get("amount_usd"), bool) or \
                            not isinstance(b.get("amount_usd"), (int, float)):
                        raise ConfigError("budget must be {amount_usd: N, period: "
                                          "day|month|total}")
                    spec.budget = Budget(float(b["amount_usd"]), str(b.get("period", "month")))
                    spec.budget.validate(name)
            if "rate_limits" in raw:
                r = raw["rate_limits"]
                spec.rate_limit = None if r is None else RateLimit.parse(name, r)
        except ConfigError as exc:
            raise InvalidRequestError(str(exc)) from None
        return spec


class TenantStore:
    """Keys -> tenants for authentication, and the admin API's writes (see the note)."""

    def __init__(self, state, database, refresh_s: float = 10.0):
        """`state`: the ServerState (its settings, recorder and limiter are updated);
        `database`: where tenants persist (the ledger's target), or None: admin writes
        are refused."""
        self.state, self.database, self.refresh_s = state, database, refresh_s
        self._lock = threading.Lock()
        self._db = None
        self._by_hash: dict[str, tuple[str, str, float]] = {}  # hash -> (key id, tenant, at)
        self.specs: dict[str, TenantSpec] = {}
        """Tenants made or changed through the admin API."""
        if database is not None:
            self._load()

    # ---------------------------------------------------------------- reading
    def _conn(self):
        if self._db is None:
            from tierserve.metering.ledger import connect
            self._db = connect(self.database)
        return self._db

    def _load(self) -> None:
        db = self._conn()
        for name, spec in db.execute("SELECT name, spec FROM tenants").fetchall():
            self._apply(name, TenantSpec.from_json(name, json.loads(spec)))

    def lookup(self, key: str) -> str | None:
        """The tenant of a key made through the admin API, or None."""
        if self.database is None:
            return None
        h = key_hash(key)
        now = time.monotonic()
        with self._lock:
            hit = self._by_hash.get(h)
            if hit is not None and now - hit[2] < self.refresh_s:
                return hit[1]
            row = self._conn().execute(
                "SELECT key_id, tenant FROM api_keys WHERE key_hash = ? AND revoked IS NULL",
                (h,)).fetchone()
            if row is None:
                self._by_hash.pop(h, None)
                return None
            self._by_hash[h] = (row[0], row[1], now)
            return row[1]

    def has_keys(self) -> bool:
        return self.database is not None

    # ---------------------------------------------------------------- writing
    def _require_db(self):
        if self.database is None:
            raise InvalidRequestError("the admin API needs a database to keep tenants in: "
                                      "start the server with --ledger or --database")
        return self._conn()

    def put(self, name: str, raw: dict) -> TenantSpec:
        """Create or change tenant `name` (fields not given keep their values)."""
        if not isinstance(name, str) or not 0 < len(name) <= 128:
            raise InvalidRequestError("a tenant name has 1 to 128 characters", param="name")
        with self._lock:
            db = self._require_db()
            spec = TenantSpec.from_json(name, raw, self.spec(name))
            with db:
                db.execute("DELETE FROM tenants WHERE name = ?", (name,))
                db.execute("INSERT INTO tenants (name, spec, updated) VALUES (?, ?, ?)",
                           (name, json.dumps(spec.to_json()), time.time()))
            self._apply(name, spec)
        return spec

    def spec(self, name: str) -> TenantSpec:
        """What is configured for `name`: the admin API's, else the YAML's, else defaults."""
        if name in self.specs:
            return self.specs[name]
        settings = self.state.settings
        yaml_tenant = next((t for t in settings.api_keys.values() if t.name == name), None)
        return TenantSpec(
            tiers=list(yaml_tenant.tiers) if yaml_tenant else list(TIER_NAMES),
            weight=yaml_tenant.weight if yaml_tenant else 1.0,
            cache_group=yaml_tenant.cache_group if yaml_tenant else None,
            budget=settings.budgets.get(name), rate_limit=settings.rate_limits.get(name))

    def _apply(self, name: str, spec: TenantSpec) -> None:
        """Make the spec live: budgets, limits, and the tenant its keys resolve to."""
        self.specs[name] = spec
        recorder = self.state.recorder
        if spec.budget is None:
            recorder.budgets.pop(name, None)
        else:
            recorder.budgets[name] = spec.budget
        self.state.limiter.set(name, spec.rate_limit)
        for key, tenant in self.state.settings.api_keys.items():  # YAML keys of this tenant
            if tenant.name == name:
                tenant.tiers, tenant.weight = list(spec.tiers), spec.weight
                tenant.cache_group = spec.cache_group

    def create_key(self, name: str) -> dict:
        """A new key for tenant `name` (made if new): the key is in this answer only."""
        if name not in self.specs:
            self.put(name, {})
        key = "sk-ts-" + secrets.token_urlsafe(32)
        key_id = "key_" + secrets.token_hex(8)
        created = time.time()
        with self._lock:
            db = self._require_db()
            with db:
                db.execute("INSERT INTO api_keys (key_id, key_hash, tenant, created) "
                           "VALUES (?, ?, ?, ?)", (key_id, key_hash(key), name, created))
        return {"id": key_id, "object": "api_key", "tenant": name, "key": key,
                "created_at": int(created)}

    def revoke(self, key_id: str) -> dict:
        with self._lock:
            db = self._require_db()
            with db:
                row = db.execute("SELECT tenant, revoked FROM api_keys WHERE key_id = ?",
                                 (key_id,)).fetchone()
                if row is None:
                    raise NotFoundError(f"no API key with id {key_id!r}", param="key_id")
                if row[1] is None:
                    db.execute("UPDATE api_keys SET revoked = ? WHERE key_id = ?",
                               (time.time(), key_id))
            self._by_hash = {h: v for h, v in self._by_hash.items() if v[0] != key_id}
        return {"id": key_id, "object": "api_key", "tenant": row[0], "revoked": True}

    def keys(self, name: str) -> list[dict]:
        with self._lock:
            rows = self._require_db().execute(
                "SELECT key_id, created, revoked FROM api_keys WHERE tenant = ? ORDER BY "
                "created", (name,)).fetchall()
        return [{"id": r[0], "object": "api_key", "tenant": name, "created_at": int(r[1]),
                 "revoked": r[2] is not None} for r in rows]

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
