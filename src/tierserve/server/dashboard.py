"""`/dashboard`: a live page of tiers, latency, cost, tenants, batch jobs and replicas.

    GET /dashboard               the page (static HTML; its script polls the data route)
    GET /dashboard/static/NAME   its script, styles and the vendored chart library
    GET /dashboard/data          one JSON snapshot: recent history and current totals

Everything the page loads comes from this server, so it works offline. Totals are read
from the Prometheus registry that /metrics renders and spend from the same function as
/v1/spend, so the page and the scrapes cannot disagree; the history is the server's own
short memory (server/timeline.py).

Where API keys are configured the dashboard needs the admin key, as HTTP Basic (any
user name, the key as password: a browser asks for it and sends it on the page's own
requests) or as `Authorization: Bearer`.
"""

import asyncio
import base64
import binascii
import contextlib
import hmac
import time
from collections import Counter
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from tierserve.errors import AuthenticationError, PermissionDeniedError
from tierserve.server import admin
from tierserve.tasks import background

STATIC = {"dashboard.js": "text/javascript", "dashboard.css": "text/css",
          "vendor/uPlot.iife.min.js": "text/javascript", "vendor/uPlot.min.css": "text/css"}


def _static(name: str) -> bytes:
    return resources.files("tierserve.server").joinpath("static", name).read_bytes()


def check_access(state, request: Request) -> None:
    settings = state.settings
    if not settings.api_keys and settings.admin_key is None and not state.tenants.specs:
        return  # an open server: its metrics are open too
    if settings.admin_key is None:
        raise PermissionDeniedError("the dashboard needs the admin key, and this server has "
                                    "API keys but no admin_key (set it in the YAML or "
                                    "TIERSERVE_ADMIN_KEY)")
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    given = value.strip()
    if scheme.lower() == "basic":
        try:
            given = base64.b64decode(given).decode().partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            given = ""
    elif scheme.lower() != "bearer":
        given = ""
    if not hmac.compare_digest(given.encode(), settings.admin_key.encode()):
        raise AuthenticationError("the dashboard needs the admin key (HTTP Basic password, "
                                  "or Authorization: Bearer)")


def register(app: FastAPI, state) -> None:
    @app.get("/dashboard", include_in_schema=False)
    async def page(request: Request):
        try:
            check_access(state, request)
        except AuthenticationError as exc:  # let the browser ask for the key
            return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error",
                                           "param": None, "code": "invalid_api_key"}},
                                status_code=401,
                                headers={"WWW-Authenticate": 'Basic realm="tierserve"'})
        return HTMLResponse(_static("dashboard.html"))

    @app.get("/dashboard/static/{name:path}", include_in_schema=False)
    async def static(name: str):
        if name not in STATIC:  # a fixed list: no path from the URL reaches the disk
            return Response(status_code=404)
        return Response(_static(name), media_type=STATIC[name],
                        headers={"Cache-Control": "max-age=3600"})

    @app.get("/dashboard/data", include_in_schema=False)
    async def data(request: Request):
        check_access(state, request)
        return snapshot(state)


@contextlib.asynccontextmanager
async def sampling(state):
    """Sample queue depth and KV use into the timeline once per bucket while serving."""
    async def loop():
        while True:
            sample(state)
            await asyncio.sleep(state.timeline.interval_s)

    async with background(loop()):
        yield


def sample(state) -> None:
    state.recorder.accrue()  # idle time to the meters and the ledger as it passes
    if not state.served:
        return
    queued, running, kv = Counter(), Counter(), []
    for served in state.served.values():
        queued.update(served.admission.queued)
        running.update(served.admission.running)
        kv += [u["kv_usage"] for u in served.backend.units() if u["kv_usage"] is not None]
    state.timeline.sample(queued, running, max(kv) if kv else None)


def units(state) -> list[dict]:
    """Every engine or replica of every served model (named `model/engine` where a
    server serves several)."""
    several = len(state.served) > 1
    return [{**u, "model": served.name,
             "name": f"{served.name}/{u['name']}" if several else u["name"]}
            for served in state.served.values() for u in served.backend.units()]


def snapshot(state) -> dict:
    sample(state)  # the newest point is now, not up to one bucket old
    backend = state.backend
    return {"now": time.time(), "model": state.model_name,
            "interval_s": state.timeline.interval_s,
            "series": state.timeline.series(), "tiers": tiers(state),
            "tenants": tenants(state), "batches": batches(state),
            "units": units(state),
            "deployment": _deployment(backend)}


def _samples(registry, name: str):
    for family in registry.collect():
        for s in family.samples:
            if s.name == name:
                yield s.labels, s.value


def _by_tier(registry, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, value in _samples(registry, name):
        out[labels["tier"]] = out.get(labels["tier"], 0.0) + value
    return out


def tiers(state) -> dict:
    """Per tier: requests, tokens, machine cost, charge, cost per 1K output tokens and SLO
    attainment, as /metrics has them; and the idle share of all machine cost."""
    r = state.metrics.registry
    requests = _by_tier(r, "tierserve_request_finished_total")
    output = _by_tier(r, "tierserve_generation_tokens_total")
    prompt = _by_tier(r, "tierserve_prompt_tokens_total")
    cost = _by_tier(r, "tierserve_machine_cost_usd_total")
    charge = _by_tier(r, "tierserve_charge_usd_total")
    met = _by_tier(r, "tierserve_slo_met_requests_total")
    checked = _by_tier(r, "tierserve_slo_checked_requests_total")
    rows = []
    for tier in sorted(set(requests) | set(cost)):
        out_tokens = output.get(tier, 0.0)
        rows.append({"tier": tier, "requests": requests.get(tier, 0.0),
                     "prompt_tokens": prompt.get(tier, 0.0), "output_tokens": out_tokens,
                     "machine_cost_usd": cost.get(tier, 0.0),
                     "charge_usd": charge.get(tier, 0.0),
                     "cost_per_1k_output_usd": 1000 * cost.get(tier, 0.0) / out_tokens
                     if out_tokens else None,
                     "slo_attainment": met.get(tier, 0.0) / checked[tier]
                     if checked.get(tier) else None})
    idle = {labels["kind"]: value for labels, value in _samples(r, "tierserve_idle_cost_usd_total")}
    idle_total = sum(idle.values())
    machine = sum(cost.values()) + idle_total
    return {"rows": rows, "idle_cost_usd": idle_total, "idle_by_kind": idle,
            "idle_share": idle_total / machine if machine else None}


def tenants(state) -> list[dict]:
    names = {t.name for t in state.settings.api_keys.values()} | set(state.tenants.specs) \
        | set(state.recorder.budgets) | set(state.recorder._charged)
    out = []
    for name in sorted(names):
        s = admin.spend(state, name)
        budget = s["budget"]
        out.append({"tenant": name, "spent_total_usd": s["by_period"]["total"]["spent_usd"],
                    "spent_today_usd": s["by_period"]["day"]["spent_usd"],
                    "reserved_usd": s["reserved_usd"],
                    "budget_usd": budget["amount_usd"] if budget else None,
                    "budget_period": budget["period"] if budget else None,
                    "remaining_usd": budget["remaining_usd"] if budget else None})
    return out


def batches(state) -> list[dict]:
    if state.batches is None:
        return []
    return [{"id": b["id"], "tenant": b["tenant"], "status": b["status"],
             "created_at": b["created_at"], **b["request_counts"],
             "charge_usd": b["cost"]["charge_usd"]} for b in state.batches.store.recent(20)]


def _deployment(backend) -> str:
    if backend is None:
        return "loading"
    units = backend.units()
    if units and units[0]["kind"] == "replica":
        return "fleet"
    return "dedicated" if len(units) > 1 else "shared"
