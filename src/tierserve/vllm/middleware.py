"""The API-server half of the plugin: `vllm serve ... --middleware
tierserve.vllm.middleware.TierserveMiddleware`.

Routes on vLLM's own port (beside /metrics, and like it without vLLM's API key):
    GET /tierserve/v1/info                  the plugin is here: version, tier settings
    GET /tierserve/v1/costs?ids=a,b         exact cost of finished requests, by the key
                                            the gateway sent (`vllm_xargs.tierserve_id`,
                                            else vLLM's own request id)
    GET /tierserve/v1/totals                machine cost per tier and phase, idle, total
    GET /tierserve/v1/steps?after=ID        the engine core's recent steps, timed as a
                                            tierserve server times them
                                            (core/step_log.py): what `tierserve calibrate
                                            --backend URL --from-steps` fits
It answers them from the engine core's CostBook (costs.py), and adds to vLLM's /metrics,
in vLLM's naming style: `vllm:tierserve_cost_usd_total{tier,phase}`,
`vllm:tierserve_idle_cost_usd_total`, `vllm:tierserve_machine_cost_usd_total` and
`vllm:tierserve_requests_total{tier}`, plus `vllm:tierserve_info{version}` 1.

It also checks `vllm_xargs.tier` on the way in: a tier that is not one of tierserve's is
a 400 in OpenAI's error shape (the scheduler, past the HTTP layer, could only guess).
"""

import asyncio
import json
import os
from urllib.parse import parse_qs

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tierserve import __version__
from tierserve.tiers import TIER_NAMES
from tierserve.vllm import costs

COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")


def book_socket() -> str:
    return costs.socket_path(os.getpid())


class _Collector:
    def __init__(self, path: str):
        self.path = path

    def collect(self):
        try:
            totals = costs.ask(self.path, "totals", timeout_s=1.0)
        except (OSError, ValueError):
            return
        info = GaugeMetricFamily("vllm:tierserve_info", "tierserve's plugin is loaded.",
                                 labels=["version"])
        info.add_metric([__version__], 1.0)
        cost = CounterMetricFamily("vllm:tierserve_cost_usd", "Machine cost attributed "
                                   "to finished requests (USD), by tier and phase.",
                                   labels=["tier", "phase"])
        done = CounterMetricFamily("vllm:tierserve_requests", "Finished requests metered, "
                                   "by tier.", labels=["tier"])
        for tier, t in totals["by_tier"].items():
            cost.add_metric([tier, "prefill"], t["prefill_usd"])
            cost.add_metric([tier, "decode"], t["decode_usd"])
            done.add_metric([tier], t["requests"])
        idle = CounterMetricFamily("vllm:tierserve_idle_cost_usd", "Machine cost of time "
                                   "with no step running (USD).")
        idle.add_metric([], totals["idle_usd"])
        machine = CounterMetricFamily("vllm:tierserve_machine_cost_usd", "Machine cost of "
                                      "this replica since it started (USD).")
        machine.add_metric([], totals["machine_usd"])
        yield from (info, cost, done, idle, machine)


_registered: set[str] = set()


class TierserveMiddleware:
    def __init__(self, app):
        self.app = app
        self.path = book_socket()
        if self.path not in _registered:  # one collector per process, however many apps
            REGISTRY.register(_Collector(self.path))
            _registered.add(self.path)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if path.startswith("/tierserve/v1/") and scope.get("method") == "GET":
            return await self._answer(path, scope, send)
        if path in COMPLETION_PATHS and scope.get("method") == "POST":
            body = await _read(receive)
            error = _bad_tier(body)
            if error is not None:
                return await _json(send, 400, error)
            return await self.app(scope, _replay(body, receive), send)
        return await self.app(scope, receive, send)

    async def _answer(self, path: str, scope, send):
        query = parse_qs(scope.get("query_string", b"").decode())
        try:
            if path == "/tierserve/v1/info":
                out = {"object": "tierserve.plugin", "version": __version__,
                       **costs.ask(self.path, "info")}
            elif path == "/tierserve/v1/totals":
                out = {"object": "tierserve.totals", **costs.ask(self.path, "totals")}
            elif path == "/tierserve/v1/steps":
                after = query.get("after", ["0"])[-1]
                if not (after.isascii() and after.isdigit()):
                    return await _json(send, 400, _error(
                        f"after must be a non-negative integer (a step record's id), got "
                        f"{after!r}", "invalid_value", param="after"))
                # up to 16,384 records: read off the event loop, which streams tokens
                out = await asyncio.to_thread(costs.ask, self.path, f"steps {int(after)}",
                                              10.0)
                if "error" in out:
                    raise ValueError(out["error"])
                out = {"object": "list", **out}
            elif path == "/tierserve/v1/costs":
                ids = [i for v in query.get("ids", []) for i in v.split(",") if i]
                out = {"object": "tierserve.costs",
                       "data": costs.ask(self.path, "costs " + json.dumps(ids))}
            else:
                return await _json(send, 404, _error(f"no route {path}", "not_found"))
        except (OSError, ValueError) as exc:
            return await _json(send, 503, _error(
                f"the engine core's cost book does not answer at {self.path} ({exc}): is "
                "the replica started with --scheduler-cls tierserve.vllm.TieredScheduler?",
                "plugin_unavailable"))
        return await _json(send, 200, out)


def _bad_tier(body: bytes) -> dict | None:
    if b"vllm_xargs" not in body:
        return None  # (cheap) nothing of ours to check
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None  # vLLM answers a bad body itself
    xargs = data.get("vllm_xargs") if isinstance(data, dict) else None
    tier = xargs.get("tier") if isinstance(xargs, dict) else None
    if tier is None or tier in TIER_NAMES:
        return None
    return _error(f"vllm_xargs.tier must be one of {', '.join(TIER_NAMES)}, got {tier!r}",
                  "invalid_value", param="vllm_xargs.tier")


def _error(message: str, code: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param,
                      "code": code}}


async def _read(receive) -> bytes:
    chunks, more = [], True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


def _replay(body: bytes, receive):
    """The body read ahead, then the client's own messages (its disconnect, for a
    stream to notice)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _json(send, status: int, body: dict) -> None:
    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(raw)).encode())]})
    await send({"type": "http.response.body", "body": raw})
