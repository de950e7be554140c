"""The endpoint picker: Envoy's `ext_proc` gRPC service over a fleet gateway's state.

NOTE: one request through Envoy
    Envoy opens one ext_proc stream per HTTP request and sends, in order, the request
    headers, the whole request body (BUFFERED), the response headers and the response
    body chunks (STREAMED), waiting for an answer to each. On the body this service
    does what `tierserve serve --backend` does on its HTTP route, with the same code
    (server/completions.py, server/routing.py, router/flow.py): the API key or the
    extension's fairness-id names the tenant, rate limits and the budget are taken, and
    the request waits in its tier's queue while the stream is held (the flow control).
    When the gateway releases it, the answer names the replica: the extension's header
    `x-gateway-destination-endpoint` (the chosen endpoint first, then the other healthy
    ones, which Envoy tries in turn if the first cannot be reached) and the same value
    in the `envoy.lb` metadata, with the body the replica should get (the client's, plus
    the tier as that replica reads it). A refusal is an immediate response in the
    OpenAI error shape: 429 (flex past its wait, rate limits, budgets), 503 (no healthy
    replica), 400 (a bad body). On the way back the replica's answer is read as it
    passes (token times, usage, the served endpoint Envoy reports), and the request is
    metered, billed and written to the ledger by the fleet backend's one accounting.

NOTE: what it does not pick
    A request that is not a completion (GET /v1/models, /health, ...) goes on with no
    destination: Envoy's fallback policy (round-robin) serves it, unmetered.
"""

import asyncio
import json
import logging
from types import SimpleNamespace

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from pydantic import ValidationError

from tierserve.epp.handoff import Handoff
from tierserve.errors import InvalidRequestError, TierserveError
from tierserve.server import completions, routing
from tierserve.server import openai_format as fmt
from tierserve.server.http_errors import error_response, validation_error
from tierserve.server.settings import gie_tier

log = logging.getLogger("tierserve.epp")

DESTINATION = "x-gateway-destination-endpoint"
"""The Inference Extension's header (and `envoy.lb` metadata key) naming the endpoint."""
SERVED = "upstream.address"
"""The ext_proc attribute Envoy fills with the endpoint that answered."""
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
METER_GRACE_S = 10.0
"""How long after the pick's stream ends its metering stream may still take it over."""
REQUEST_ID = "x-tierserve-request-id"
"""The request header the pick sets, by which the metering stream finds its request (and
which Envoy copies to the response as `x-request-id`: envoy.py)."""
SERVED_TIER = "x-tierserve-served-tier"
"""Set on the request; Envoy copies it to the response."""


RESOLVE_TTL_S = 10.0
"""How long a replica's resolved address is kept (a StatefulSet pod's name is stable,
its IP changes when it is rescheduled)."""
_resolved: dict[str, tuple[float, str]] = {}


def address(url: str) -> tuple[str, int]:
    """A replica URL's (IP, port), as Envoy names its endpoints (a DNS name resolved, at
    most every RESOLVE_TTL_S)."""
    import ipaddress
    import socket
    import time
    from urllib.parse import urlsplit

    u = urlsplit(url)
    host, port = u.hostname or "", u.port or (443 if u.scheme == "https" else 80)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        now = time.monotonic()
        seen = _resolved.get(host)
        if seen is None or now - seen[0] > RESOLVE_TTL_S:
            try:
                seen = (now, socket.gethostbyname(host))
            except OSError:
                seen = seen or (now, host)  # unknown for now: Envoy will not find it
            _resolved[host] = seen
        host = seen[1]
    return host, port


def endpoint(url: str) -> str:
    """A replica URL's `IP:port`, Envoy's name for the endpoint."""
    host, port = address(url)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _value(h) -> str:
    """A HeaderValue's value (Envoy sends it as raw bytes)."""
    return h.raw_value.decode() if h.raw_value else h.value


def _header(headers, key: str, default: str | None = None) -> str | None:
    """The value of header `key` in an ext_proc HeaderMap."""
    return next((_value(h) for h in headers.headers if h.key == key), default)


def _continue() -> pb.CommonResponse:
    return pb.CommonResponse()


def _set_headers(mutation, headers: dict) -> None:
    """Set `headers` in an ext_proc HeaderMutation, replacing any of the same name."""
    for k, v in headers.items():
        mutation.set_headers.add(
            header=base_pb2.HeaderValue(key=k.lower(), raw_value=str(v).encode()),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def _immediate(exc: Exception) -> pb.ProcessingResponse:
    r = error_response(exc)
    out = pb.ImmediateResponse(status=http_status_pb2.HttpStatus(code=r.status_code),
                               body=bytes(r.body), details="tierserve_epp")
    _set_headers(out.headers, {"content-type": "application/json", **{
        k: v for k, v in r.headers.items() if k.lower() not in ("content-length",
                                                                 "content-type")}})
    return pb.ProcessingResponse(immediate_response=out)


class _Exchange:
    """One HTTP request's ext_proc stream."""

    def __init__(self, picker: "Picker"):
        self.picker = picker
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.rid: str | None = None
        self.slot = None
        self.run = None
        self.drain: asyncio.Task | None = None
        self.tier = None
        self.ended = False
        self.metered = False
        """A metering stream (the second filter) took the answer over."""

    # ----------------------------------------------------------- request
    def request_headers(self, msg) -> pb.ProcessingResponse:
        for h in msg.request_headers.headers.headers:
            self.headers[h.key.lower()] = _value(h)
        return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=_continue()))

    async def request_body(self, msg) -> pb.ProcessingResponse:
        self.body += msg.request_body.body
        if not msg.request_body.end_of_stream:
            return pb.ProcessingResponse(request_body=pb.BodyResponse(response=_continue()))
        path = self.headers.get(":path", "").split("?")[0]
        if path not in completions.KINDS or self.headers.get(":method") != "POST":
            return pb.ProcessingResponse(request_body=pb.BodyResponse(response=_continue()))
        try:
            return await self._pick(path)
        except TierserveError as exc:
            return _immediate(exc)

    async def _pick(self, path: str) -> pb.ProcessingResponse:
        state = self.picker.state
        kind, model = completions.KINDS[path]
        try:
            raw = json.loads(self.body or b"{}")
        except ValueError:
            raise InvalidRequestError("the request body is not valid JSON") from None
        if not isinstance(raw, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        tenant = state.authenticate(SimpleNamespace(headers=self.headers))
        if raw.get("service_tier") is None and gie_tier(self.headers) is not None:
            raw["service_tier"] = gie_tier(self.headers)
        try:
            body = model.model_validate(raw)
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None
        state.ready()
        state.check_model(body.model)
        if body.n != 1:
            raise InvalidRequestError("n must be 1 through the endpoint picker (a choice "
                                      "per request: the replica answers each request once)",
                                      param="n")
        choice = routing.choose(state, body, tenant)
        found = completions.prompts(state, body, choice.served.backend)
        if len(found) != 1:
            raise InvalidRequestError("one prompt per request through the endpoint picker",
                                      param="prompt")
        self.rid = fmt.new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.slot = self.picker.handoff.open(self.rid, raw)
        try:
            self.run, self.tier = await completions.start(state, body, found, tenant,
                                                          self.rid, choice)
        except BaseException:
            self.picker.handoff.close(self.rid)
            raise
        self.drain = asyncio.create_task(self._drain())
        await asyncio.wait({self.slot.sent, self.drain}, return_when=asyncio.FIRST_COMPLETED)
        if not self.slot.sent.done():  # refused or failed before it was released
            self.ended = True
            self._forget()
            exc = self.drain.exception() if not self.drain.cancelled() else None
            raise exc if isinstance(exc, TierserveError) else InvalidRequestError(
                f"the request ended before a replica was chosen: {exc}")
        spec, upstream = self.slot.sent.result()
        picked = endpoint(spec.url)
        others = [endpoint(self.picker.backend.specs[r.name].url)
                  for r in self.picker.backend.gateway.replicas
                  if r.healthy and r.name != spec.name and r.takes(self.tier)]
        targets = ",".join([picked, *others])
        data = json.dumps(upstream).encode()
        common = pb.CommonResponse(status=pb.CommonResponse.CONTINUE_AND_REPLACE,
                                   body_mutation=pb.BodyMutation(body=data))
        self.picker.exchanges[self.rid] = self
        _set_headers(common.header_mutation, {
            DESTINATION: targets, "content-length": len(data), REQUEST_ID: self.rid,
            SERVED_TIER: self.tier.label, **spec.auth_headers,
            **({"x-tierserve-usage": "comment"} if spec.kind == "tierserve" else {})})
        meta = struct_pb2.Struct()
        meta.update({"envoy.lb": {DESTINATION: targets}})
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common),
                                     dynamic_metadata=meta)

    async def _drain(self) -> None:
        """Read the request's outputs to its end (admission counts, the refusal)."""
        try:
            async for _ in self.run.outputs():
                pass
        finally:
            self.run.close()

    # ------------------------------------------ what the metering stream tells
    def status(self, msg) -> None:
        status = _header(msg.response_headers.headers, ":status", "200")
        self.slot.status = int(status) if status.isdigit() else 502
        served = _served(msg)
        if served is not None:
            self.picker.moved(self.rid, served)
        if msg.response_headers.end_of_stream:
            self.end()

    def chunk(self, msg) -> None:
        self.slot.feed(msg.response_body.body)
        if msg.response_body.end_of_stream:
            self.end()

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.slot.end()
            self._forget()

    def abort(self) -> None:
        """The answer did not end (the client went away, or the replica broke): the
        request ends as aborted, billed for what it ran."""
        if not self.ended:
            self.ended = True
            if self.run is not None:
                self.run.close()
            self._forget()

    def _forget(self) -> None:
        if self.rid is not None:
            self.picker.handoff.close(self.rid)
            self.picker.exchanges.pop(self.rid, None)

    def closed(self) -> None:
        """The pick's stream is over (it ends once the body is answered). The metering
        stream's messages are not waited for by Envoy, so they may come later: an answer
        no metering stream took over within METER_GRACE_S ends as cut (said once)."""
        if self.metered or self.ended or self.run is None:
            if self.run is None:
                self._forget()
            return
        asyncio.get_running_loop().call_later(METER_GRACE_S, self._unmetered)

    def _unmetered(self) -> None:
        if self.metered or self.ended:
            return
        if not self.picker.warned:
            self.picker.warned = True
            log.warning("no metering stream for %s: is the second ext_proc filter "
                        "(observability mode) missing from Envoy's config? (tierserve epp "
                        "--print-envoy-config writes both); its answer is billed as cut",
                        self.rid)
        self.abort()


def _served(msg) -> str | None:
    for attrs in msg.attributes.values():
        if SERVED in attrs.fields:
            return attrs.fields[SERVED].string_value or None
    return None


class Picker(pb_grpc.ExternalProcessorServicer):
    def __init__(self, state, backend, handoff: Handoff):
        self.state, self.backend, self.handoff = state, backend, handoff
        self.warned = False
        self.exchanges: dict[str, _Exchange] = {}
        """Requests placed and not yet ended, by request id (the metering stream finds
        its request here)."""

    def moved(self, request_id: str, address: str) -> None:
        for name, spec in self.backend.specs.items():
            if endpoint(spec.url) == address:
                self.backend.moved(request_id, name)
                return

    async def Process(self, request_iterator, context):
        ex = _Exchange(self)
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("request")
                if msg.observability_mode:  # the metering filter's stream: nothing to answer
                    await self._meter(msg, kind, request_iterator)
                    return
                if kind == "request_headers":
                    yield ex.request_headers(msg)
                    if msg.request_headers.end_of_stream:
                        return  # no body: nothing to pick (the fallback policy serves it)
                elif kind == "request_body":
                    yield await ex.request_body(msg)
                    if msg.request_body.end_of_stream:
                        return  # picked: the metering stream reads the answer
                else:  # not asked for in the config this service writes
                    yield pb.ProcessingResponse()
        finally:
            ex.closed()

    async def _meter(self, first, kind: str, messages) -> None:
        """The second ext_proc filter's stream (observability mode: Envoy does not wait
        for it): the request's id in its headers, then the answer as it passes."""
        ex = None
        if kind == "request_headers":
            rid = _header(first.request_headers.headers, REQUEST_ID)
            ex = self.exchanges.get(rid)
        if ex is None:
            return  # not a request the picker placed: the stream is closed at once
        ex.metered = True
        try:
            async for msg in messages:
                kind = msg.WhichOneof("request")
                if kind == "response_headers":
                    ex.status(msg)
                elif kind == "response_body":
                    ex.chunk(msg)
                if ex.ended:  # close it now: Envoy would keep it open a while longer
                    return
        finally:
            ex.abort()  # a no-op once it ended


async def start(state, backend, handoff: Handoff, host: str, port: int):
    """The gRPC server (ext_proc and health checking) on host:port, started; returns
    the coroutine function that stops it."""
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(Picker(state, backend, handoff), server)
    checker = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise TierserveError(f"cannot listen for gRPC on {host}:{port}")
    await server.start()

    async def report() -> None:  # serving while any replica is healthy
        while True:
            ok = backend.errored is None
            status = health_pb2.HealthCheckResponse.SERVING if ok else \
                health_pb2.HealthCheckResponse.NOT_SERVING
            for name in ("", SERVICE):
                await checker.set(name, status)
            await asyncio.sleep(1.0)

    reporting = asyncio.create_task(report())

    async def stop() -> None:
        reporting.cancel()
        await server.stop(grace=1.0)

    return stop
