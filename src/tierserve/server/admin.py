"""The admin API (behind `admin_key`) and each tenant's view of its own spend.

    PUT    /admin/v1/tenants/{name}           create or change: tiers, weight, cache_group,
                                              budget {amount_usd, period}, rate_limits
    GET    /admin/v1/tenants                  every tenant known (YAML and database)
    GET    /admin/v1/tenants/{name}           one, with its spend
    POST   /admin/v1/tenants/{name}/keys      a new key (shown in this answer only)
    GET    /admin/v1/tenants/{name}/keys      its keys' ids (never the keys)
    DELETE /admin/v1/keys/{key_id}            revoke a key
    GET    /v1/spend                          the caller's tenant: spent, reserved, remaining

Changes take effect at once (budgets, rate limits, tiers, weight, cache group) and are
kept in the database (server/tenants.py).
"""

import hmac
import time

from fastapi import FastAPI, Request

from tierserve.errors import AuthenticationError, NotFoundError
from tierserve.metering.recorder import PERIODS, Budget


def spend(state, tenant: str) -> dict:
    """A tenant's spend by period, what its running requests hold, and what is left."""
    recorder = state.recorder
    budget = recorder.budgets.get(tenant)
    now = time.time()
    by_period = {}
    for period in PERIODS:
        start = Budget(0, period).period_start(now)
        by_period[period] = {"since": int(start), "spent_usd": recorder.spent_since(tenant,
                                                                                     start)}
    reserved = recorder.reserved(tenant)
    out = {"object": "tenant.spend", "tenant": tenant, "reserved_usd": reserved,
           "by_period": by_period, "budget": None}
    if state.open_mode:  # one owner: the machine's cost is theirs to see, idle included
        out["machine"] = recorder.machine_totals()
    if budget is not None:
        spent = recorder.spent(tenant)
        out["budget"] = {"amount_usd": budget.amount_usd, "period": budget.period,
                         "spent_usd": spent,
                         "remaining_usd": max(0.0, budget.amount_usd - spent - reserved)}
    return out


def register(app: FastAPI, state) -> None:
    store = state.tenants

    def admin(request: Request) -> None:
        key = state.settings.admin_key
        header = request.headers.get("authorization", "")
        given = header[7:].strip() if header.lower().startswith("bearer ") else ""
        if key is None:
            raise NotFoundError("the admin API is off on this server (set admin_key)")
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise AuthenticationError("missing or invalid admin key (Authorization: Bearer "
                                      "...)")

    def known(name: str) -> None:
        names = {t.name for t in state.settings.api_keys.values()} | set(store.specs)
        if name not in names:
            raise NotFoundError(f"no tenant named {name!r}", param="name")

    def card(name: str) -> dict:
        return {"object": "tenant", "name": name, **store.spec(name).to_json()}

    @app.put("/admin/v1/tenants/{name}")
    async def put_tenant(name: str, request: Request):
        admin(request)
        raw = await _json(request)
        store.put(name, raw)
        return card(name)

    @app.get("/admin/v1/tenants")
    async def list_tenants(request: Request):
        admin(request)
        names = sorted({t.name for t in state.settings.api_keys.values()} | set(store.specs))
        return {"object": "list", "data": [card(n) for n in names]}

    @app.get("/admin/v1/tenants/{name}")
    async def get_tenant(name: str, request: Request):
        admin(request)
        known(name)
        return {**card(name), "spend": spend(state, name)}

    @app.post("/admin/v1/tenants/{name}/keys")
    async def create_key(name: str, request: Request):
        admin(request)
        return store.create_key(name)

    @app.get("/admin/v1/tenants/{name}/keys")
    async def list_keys(name: str, request: Request):
        admin(request)
        known(name)
        return {"object": "list", "data": store.keys(name)}

    @app.delete("/admin/v1/keys/{key_id}")
    async def revoke_key(key_id: str, request: Request):
        admin(request)
        return store.revoke(key_id)

    @app.get("/v1/spend")
    async def own_spend(request: Request):
        return spend(state, state.authenticate(request).name)


async def _json(request: Request) -> dict:
    import json

    from tierserve.errors import InvalidRequestError
    try:
        raw = json.loads(await request.body() or b"{}")
    except ValueError:
        raise InvalidRequestError("the request body is not valid JSON") from None
    if not isinstance(raw, dict):
        raise InvalidRequestError("expected a JSON object")
    return raw


class SpendCollector:
    """Prometheus gauges read at each scrape, per tenant known to the server:
    `tierserve_tenant_spend_usd{tenant,period}` (this day, month, all time),
    `tierserve_tenant_reserved_usd{tenant}` (held by running requests) and, for tenants
    with a budget, `tierserve_tenant_budget_remaining_usd{tenant}`."""

    def __init__(self, state):
        self.state = state

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        spent = GaugeMetricFamily("tierserve_tenant_spend_usd", "What a tenant was charged "
                                  "since the start of the period (UTC).", labels=["tenant",
                                                                                 "period"])
        held = GaugeMetricFamily("tierserve_tenant_reserved_usd", "Worst-case charges held "
                                 "by a tenant's admitted, unfinished requests.", labels=["tenant"])
        left = GaugeMetricFamily("tierserve_tenant_budget_remaining_usd", "Budget left this "
                                 "period, after spend and holds.", labels=["tenant"])
        state = self.state
        names = {t.name for t in state.settings.api_keys.values()} | set(state.tenants.specs) \
            | set(state.recorder.budgets)
        for name in sorted(names):
            s = spend(state, name)
            for period, figures in s["by_period"].items():
                spent.add_metric([name, period], figures["spent_usd"])
            held.add_metric([name], s["reserved_usd"])
            if s["budget"] is not None:
                left.add_metric([name], s["budget"]["remaining_usd"])
        return [spent, held, left]
