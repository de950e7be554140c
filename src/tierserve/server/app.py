"""The FastAPI app: OpenAI-compatible routes over a backend (router/backend.py).

`create_app(backend, settings)` holds all state on `app.state.tierserve`; nothing is
global. Errors are typed (`tierserve.errors`) and mapped to status codes once
(server/http_errors.py).
"""

import contextlib
import inspect
from dataclasses import dataclass

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tierserve.core.stats import RequestStats
from tierserve.core.step_log import StepLog
from tierserve.tiers import Tier, resolve
from tierserve import __version__
from tierserve.errors import (AuthenticationError, InvalidRequestError, LoadingError,
                              NotFoundError, RequestTooLargeError, TierNotAllowedError,
                              TierserveError)
from tierserve.metering.ledger import Ledger
from tierserve.metering.recorder import Recorder
from tierserve.router.backend import Backend
from tierserve.server import admin, batches, capacity, completions, dashboard, routing
from tierserve.server import openai_format as fmt
from tierserve.server.admission import Admission
from tierserve.server.http_errors import error_response, validation_error
from tierserve.server.limits import RateLimiter
from tierserve.server.tenants import TenantStore
from tierserve.server.metrics import Metrics
from tierserve.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                       DetokenizeRequest, TokenizeRequest)
from tierserve.server.settings import (FAIRNESS_HEADER, OPEN_TENANT, ServerSettings, Tenant,
                                       gie_tier)
from tierserve.server.timeline import Timeline


@dataclass
class Served:
    """One model this server serves: its backend and its admission queues."""

    name: str
    backend: Backend
    admission: Admission


class ServerState:
    """Everything the routes share. The backend is attached once it is ready (the model
    loaded, or the fleet's replicas known); a server serving several models (YAML
    `models:`) attaches one per model, the main one first."""

    def __init__(self, settings: ServerSettings, model_name: str):
        self.settings = settings
        self.model_name = model_name
        self.metrics = Metrics(model_name)
        self.timeline = Timeline()
        self.step_log = StepLog(model_name)
        self.recorder = Recorder(model_name, settings.prices,
                                 Ledger(settings.ledger_target)
                                 if settings.ledger_target else None,
                                 settings.budgets)
        self.metrics.watch_idle(self.recorder)
        self.limiter = RateLimiter(settings.rate_limits, shared=self.recorder.shared)
        self.tenants = TenantStore(self, settings.ledger_target)
        self.backend: Backend | None = None
        self.admission: Admission | None = None
        """The main model's (the only one, unless YAML `models:` adds more)."""
        self.served: dict[str, Served] = {}
        self.routes = dict(settings.routes)
        self.aliases = dict(settings.aliases)
        self.classifier = None
        if settings.route_classifier:
            from tierserve.route.classifier import Classifier
            self.classifier = Classifier.load(settings.route_classifier)
        self.capacity = capacity.Capacity(self, settings.schedule) if settings.schedule \
            else None
        self.batches = batches.Batches(self, settings.data_dir) if settings.data_dir \
            else None

    def attach(self, backend: Backend, name: str | None = None) -> None:
        """The main model's backend (`name` None), or another model's."""
        backend.meter(self.recorder, self.settings.price_per_hour, self)
        admission = Admission(self.settings.queue_limits, backend.max_num_seqs)
        self.served[name or self.model_name] = Served(name or self.model_name, backend,
                                                      admission)
        if name is not None:
            return
        self.metrics.slo = dict(backend.slo)
        if backend.kv_blocks_in_use() is not None:  # where this process holds the KV cache
            self.metrics.watch_kv_blocks(backend.kv_blocks_in_use)
            self.metrics.vllm.cache_config_info(*backend.kv_cache_config())
        self.admission = admission
        self.backend = backend

    def target(self, model: str) -> Served:
        """The served model called `model` or an alias of it (YAML `aliases:`; a route is
        not one: see server/routing.py)."""
        self.ready()
        served = self.served.get(self.aliases.get(model, model))
        if served is None:
            self.check_model(model)
            raise LoadingError(f"the model `{model}` is still loading")
        return served

    @property
    def names(self) -> list[str]:
        """Every name a client may call: the models (the main one first), aliases, routes."""
        return [self.model_name, *(m for m in self.served if m != self.model_name),
                *self.aliases, *self.routes]

    # StatSink: after metering, so the stats carry their cost and charge
    def on_step(self, stats) -> None:
        self.metrics.on_step(stats)
        self.timeline.on_step(stats)
        self.step_log.on_step(stats)

    def on_request_finished(self, stats: RequestStats) -> None:
        self.metrics.observe_request(stats)
        self.timeline.on_request_finished(stats)

    def ready(self) -> Backend:
        if self.backend is None:
            raise LoadingError("the model is still loading; retry in a few seconds")
        return self.backend

    @property
    def open_mode(self) -> bool:
        """No API keys and no admin key: loopback only, one owner."""
        return not self.settings.api_keys and self.settings.admin_key is None

    def authenticate(self, request: Request) -> Tenant:
        keys = self.settings.api_keys
        if self.open_mode:  # an Inference Extension gateway may name who asks
            fairness = request.headers.get(FAIRNESS_HEADER, "").strip()
            return Tenant(fairness[:128]) if fairness else OPEN_TENANT
        header = request.headers.get("authorization", "")
        key = header[7:].strip() if header.lower().startswith("bearer ") else ""
        if key in keys:
            return keys[key]
        name = self.tenants.lookup(key) if key else None  # made through the admin API
        if name is None:
            raise AuthenticationError("missing or invalid API key (Authorization: Bearer ...)")
        return self.tenant_named(name)

    def tenant_named(self, name: str) -> Tenant:
        """The tenant called `name` (a batch job's owner, a key's), as configured."""
        spec = self.tenants.specs.get(name)
        if spec is not None:
            return Tenant(name, list(spec.tiers), spec.weight, spec.cache_group)
        for tenant in self.settings.api_keys.values():
            if tenant.name == name:
                return tenant
        return Tenant(name) if name != OPEN_TENANT.name else OPEN_TENANT

    def tokenizer(self):
        tok = self.ready().tokenizer
        if tok is None:
            raise NotFoundError("this server has no tokenizer for its model (a gateway "
                                "started without the model's files)")
        return tok

    def check_model(self, model: str) -> None:
        if model not in self.names:
            raise NotFoundError(f"the model `{model}` does not exist; this server serves "
                                f"{', '.join(f'`{m}`' for m in self.names)}", param="model",
                                code="model_not_found")

    def tier_for(self, asked: Tier, tenant: Tenant) -> Tier:
        """The tier this tenant's request asking for `asked` runs in (tiers.resolve;
        with `strict_tiers`, 403 instead of another tier)."""
        tier = resolve(asked, tenant.allowed)
        if tier is None or (tier != asked and self.settings.strict_tiers):
            raise TierNotAllowedError(f"tenant {tenant.name!r} may not use the {asked} tier "
                                      f"(allowed: {', '.join(tenant.tiers)})")
        return tier


def create_app(backend: Backend | None, settings: ServerSettings,
               model_name: str = "default") -> FastAPI:
    """`backend`: None to attach one later (`app.state.tierserve.attach`); an in-process
    engine is a `router.local.LocalBackend`."""
    settings.validate()
    state = ServerState(settings, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async with dashboard.sampling(state), capacity.following(state), \
                batches.running(state):
            yield  # batches stop first: their lines abort cleanly
        if state.backend is not None:
            await state.backend.stop()
        state.recorder.close()
        state.tenants.close()
        # FastAPI keeps endpoint functions in a process-wide cache, and ours close over
        # this state: drop what holds the engines, so an app stopped in a process that
        # goes on (an embedder, the test suite) gives their memory back.
        state.backend = state.admission = None
        state.served = {}

    # FastAPI's own OpenTelemetry hooks (where this FastAPI has them) read the environment
    # on every request: 9% of a gateway's CPU at its ceiling. tierserve exports Prometheus.
    quiet = {"telemetry": {"tracing": False, "metrics": False, "logs": False}} \
        if "telemetry" in inspect.signature(FastAPI).parameters else {}
    docs = {"docs_url": None, "redoc_url": None, "openapi_url": None} \
        if settings.disable_fastapi_docs else {}
    app = FastAPI(title="tierserve", lifespan=lifespan, **quiet, **docs)
    app.state.tierserve = state
    if backend is not None:
        state.attach(backend)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes,
                       paths={"/v1/files": settings.max_file_bytes + batches.CHUNK})
    _add_error_handlers(app)
    batches.register(app, state)
    admin.register(app, state)
    dashboard.register(app, state)
    state.metrics.registry.register(admin.SpendCollector(state))

    @app.get("/health")
    async def health():
        if state.backend is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        if state.backend.errored is not None:
            return JSONResponse({"status": "error", "detail": str(state.backend.errored)},
                                status_code=503)
        return {"status": "ok"}

    def model_card(name: str) -> dict:
        state.ready()
        if name in state.routes:  # an alias: its models are what it may answer with
            return {"id": name, "object": "model", "created": 0, "owned_by": "tierserve",
                    "routes_to": sorted(state.routes[name].models)}
        served = state.target(name)
        card = {"id": name, "object": "model", "created": 0, "owned_by": "tierserve",
                "max_model_len": served.backend.max_model_len,
                "max_num_seqs": served.backend.max_num_seqs}
        if served.name != name:
            card["alias_of"] = served.name
        return card

    @app.get("/v1/models")
    async def models(request: Request):
        state.authenticate(request)
        return {"object": "list", "data": [model_card(m) for m in state.names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        state.authenticate(request)
        state.check_model(model_id)
        return model_card(model_id)

    @app.get("/v1/schedule")
    async def schedule(request: Request):
        """The capacity schedule in force: for an autoscaler (replicas per pool) and for
        operators (what the engines were set to)."""
        dashboard.check_access(state, request)
        if state.capacity is None:
            raise NotFoundError("this server has no capacity schedule (YAML `schedule:`)")
        return state.capacity.status()

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        state.authenticate(request)
        state.check_model(body.model)
        tok = state.tokenizer()
        if body.messages is not None:
            tokens = tok.apply_chat_template([{"role": m.template_role, "content": m.text()}
                                              for m in body.messages])
        else:
            tokens = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": state.ready().max_model_len,
                "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request):
        state.authenticate(request)
        state.check_model(body.model)
        tok = state.tokenizer()
        if any(t < 0 or t >= tok.vocab_size for t in body.tokens):
            raise InvalidRequestError(f"tokens must be ids in [0, {tok.vocab_size})",
                                      param="tokens")
        return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/metrics")
    async def metrics():
        for served in state.served.values():
            state.metrics.set_queue_gauges(served.admission.queued, served.admission.running,
                                           served.backend.units(), served.name)
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/tierserve/v1/steps")
    async def steps(request: Request, after: int = Query(0, ge=0)):
        """This server's recent engine steps, with ids above `after` (core/step_log.py):
        what `tierserve calibrate --backend URL --from-steps` fits. Operators' data, as
        the schedule: the admin key where the server has keys."""
        dashboard.check_access(state, request)
        data, last_id = state.step_log.after(after)
        return {"object": "list", "data": data, "last_id": last_id}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        tenant = state.authenticate(request)
        state.ready()
        state.check_model(body.model)
        if body.service_tier is None:
            body.service_tier = gie_tier(request.headers)
        choice = routing.choose(state, body, tenant)
        return await completions.serve(
            state, "chat", body, completions.prompts(state, body, choice.served.backend),
            tenant, choice, _wants_notice(request), _wants_usage_comment(request))

    @app.post("/v1/completions")
    async def text_completions(body: CompletionRequest, request: Request):
        tenant = state.authenticate(request)
        state.ready()
        state.check_model(body.model)
        if body.service_tier is None:
            body.service_tier = gie_tier(request.headers)
        choice = routing.choose(state, body, tenant)
        return await completions.serve(
            state, "completion", body, completions.prompts(state, body, choice.served.backend),
            tenant, choice, _wants_notice(request), _wants_usage_comment(request))

    return app


def _wants_usage_comment(request: Request) -> bool:
    """`x-tierserve-usage: comment`: a stream that did not ask for usage ends with it in an
    SSE comment, which clients skip (how an endpoint picker meters a stream it must not
    change, epp/service.py)."""
    return request.headers.get("x-tierserve-usage", "").lower() == "comment"


def _wants_notice(request: Request) -> bool:
    """`x-tierserve-notice: 1`: a stream routed to a batched tier says so in an event."""
    return request.headers.get("x-tierserve-notice", "").lower() in ("1", "true", "yes")


class BodyLimit:
    """ASGI middleware: 413 for a body over the limit, by header or as it streams in.
    `paths` gives some paths their own limit (file uploads)."""

    def __init__(self, app, limit: int, paths: dict[str, int] | None = None):
        self.app, self.default_limit, self.paths = app, limit, dict(paths or {})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.paths.get(scope.get("path"), self.default_limit)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            response = error_response(RequestTooLargeError(
                f"request body of {int(length)} bytes exceeds the {limit}-byte limit"))
            return await response(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise RequestTooLargeError(f"request body exceeds the {limit}-byte limit")
            return message

        await self.app(scope, limited_receive, send)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(TierserveError)
    async def on_tierserve_error(request, exc):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request, exc: RequestValidationError):
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request, exc: StarletteHTTPException):
        otype = "invalid_request_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(fmt.error_body(str(exc.detail), otype, code=code),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def on_unexpected(request, exc: Exception):
        return error_response(exc)
