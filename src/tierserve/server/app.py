"""The FastAPI app: OpenAI-compatible routes over an AsyncEngine.

`create_app(engine, settings)` holds all state on `app.state.tierserve`; nothing is global.
Errors are typed (`tierserve.errors`) and mapped to status codes once, in `ERRORS`.
"""

import contextlib

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tierserve.batch import routes as batch_routes
from tierserve.batch.routes import CHUNK
from tierserve.engine.async_engine import AsyncEngine
from tierserve.engine.stats import RequestStats
from tierserve.errors import (AuthenticationError, ConflictError, ContextLengthError,
                              InvalidRequestError, NotFoundError, OverloadedError,
                              RequestTooLargeError, TierNotAllowedError, TierserveError)
from tierserve.metering.ledger import Ledger
from tierserve.metering.recorder import Recorder
from tierserve.router.dedicated import DedicatedEngines
from tierserve.server import completions
from tierserve.server import openai_format as fmt
from tierserve.server.admission import Admission
from tierserve.server.metrics import Metrics
from tierserve.server.protocol import ChatCompletionRequest, CompletionRequest
from tierserve.server.settings import OPEN_TENANT, ServerSettings, Tenant, resolve_tier

ERRORS: list[tuple[type[Exception], int, str]] = [
    # exception type, HTTP status, OpenAI error type (first match wins)
    (ContextLengthError, 400, "invalid_request_error"),
    (InvalidRequestError, 400, "invalid_request_error"),
    (AuthenticationError, 401, "invalid_request_error"),
    (TierNotAllowedError, 403, "permission_error"),
    (NotFoundError, 404, "invalid_request_error"),
    (ConflictError, 409, "invalid_request_error"),
    (RequestTooLargeError, 413, "invalid_request_error"),
    (OverloadedError, 429, "rate_limit_error"),
]
_DEFAULT_CODES = {401: "invalid_api_key", 403: "tier_not_allowed", 404: "not_found",
                  409: "conflict", 413: "request_too_large"}


def error_response(exc: Exception) -> JSONResponse:
    for etype, status, otype in ERRORS:
        if isinstance(exc, etype):
            code = getattr(exc, "code", None) or _DEFAULT_CODES.get(status)
            headers = ({"Retry-After": str(exc.retry_after_s)}
                       if isinstance(exc, OverloadedError) else None)
            body = fmt.error_body(str(exc), otype, getattr(exc, "param", None), code)
            return JSONResponse(body, status_code=status, headers=headers)
    return JSONResponse(fmt.error_body("internal error: " + str(exc), "server_error",
                                       code="internal_error"), status_code=500)


class ServerState:
    """Everything the routes share. The engine is attached once the model has loaded."""

    def __init__(self, settings: ServerSettings, model_name: str):
        self.settings = settings
        self.model_name = model_name
        self.metrics = Metrics(model_name)
        self.recorder = Recorder(model_name, settings.prices,
                                 Ledger(settings.ledger) if settings.ledger else None,
                                 settings.budgets, on_cost=self.metrics.observe_cost,
                                 on_idle=self.metrics.observe_idle)
        self.engine: AsyncEngine | DedicatedEngines | None = None
        self.admission: Admission | None = None
        self.batches = batch_routes.Batches(self, settings.data_dir) if settings.data_dir \
            else None

    def attach(self, engine: "AsyncEngine | DedicatedEngines") -> None:
        price = self.settings.price_per_hour
        for part in engine.engines:
            sched = part.engine.config.scheduler
            reserved = 1.0 if part is not engine.engines[-1] else \
                sched.reserved_priority_seqs / sched.max_num_seqs  # a dedicated fast lane: all
            self.recorder.attach(part.engine, price, reserved)
            part.engine.stat_sinks.append(self)
        self.metrics.slo = dict(engine.engine.config.tiers.slo)
        self.admission = Admission(self.settings.queue_limits,
                                   engine.engine.config.scheduler.max_num_seqs)
        self.engine = engine

    def on_step(self, stats) -> None:
        self.metrics.on_step(stats)

    def on_request_finished(self, stats: RequestStats) -> None:
        self.metrics.observe_request(stats.tier, stats)

    def ready_engine(self) -> "AsyncEngine | DedicatedEngines":
        if self.engine is None:
            raise OverloadedError("the model is still loading", retry_after_s=5,
                                  code="model_loading")
        return self.engine

    def authenticate(self, request: Request) -> Tenant:
        keys = self.settings.api_keys
        if not keys:
            return OPEN_TENANT
        header = request.headers.get("authorization", "")
        key = header[7:].strip() if header.lower().startswith("bearer ") else ""
        if key not in keys:
            raise AuthenticationError("missing or invalid API key (Authorization: Bearer ...)")
        return keys[key]

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise NotFoundError(f"the model `{model}` does not exist; this server serves "
                                f"`{self.model_name}`", param="model")

    def tier_for(self, requested: str | None, tenant: Tenant) -> str:
        tier = resolve_tier(requested, tenant)
        wanted = "default" if requested in (None, "auto") else requested
        if tier is None or (tier != wanted and self.settings.strict_tiers):
            raise TierNotAllowedError(f"tenant {tenant.name!r} may not use the {wanted} tier "
                                      f"(allowed: {', '.join(tenant.tiers)})")
        return self.engine.served_tier(tier)


def create_app(engine: AsyncEngine | None, settings: ServerSettings,
               model_name: str = "default") -> FastAPI:
    settings.validate()
    state = ServerState(settings, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async with batch_routes.running(state):  # stopped first: its lines abort cleanly
            yield
        if state.engine is not None:
            await state.engine.stop()
            for part in state.engine.engines:  # the engine may outlive this app (tests)
                if state in part.engine.stat_sinks:
                    part.engine.stat_sinks.remove(state)
        state.recorder.close()

    app = FastAPI(title="tierserve", lifespan=lifespan)
    app.state.tierserve = state
    if engine is not None:
        state.attach(engine)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes,
                       paths={"/v1/files": settings.max_file_bytes + CHUNK})
    _add_error_handlers(app)
    batch_routes.register(app, state)

    @app.get("/health")
    async def health():
        if state.engine is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        if state.engine.errored is not None:
            return JSONResponse({"status": "error", "detail": str(state.engine.errored)},
                                status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        state.authenticate(request)
        eng = state.ready_engine().engine
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": 0, "owned_by": "tierserve",
            "max_model_len": eng.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        if state.admission is not None:
            state.metrics.set_queue_gauges(state.admission.queued, state.admission.running)
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        tenant = state.authenticate(request)
        state.ready_engine()
        state.check_model(body.model)
        return await completions.serve(state, "chat", body,
                                       completions.chat_prompts(state, body), tenant)

    @app.post("/v1/completions")
    async def text_completions(body: CompletionRequest, request: Request):
        tenant = state.authenticate(request)
        state.ready_engine()
        state.check_model(body.model)
        return await completions.serve(state, "completion", body,
                                       completions.completion_prompts(state, body), tenant)

    return app


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
        return error_response(completions.validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request, exc: StarletteHTTPException):
        otype = "invalid_request_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(fmt.error_body(str(exc.detail), otype, code=code),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def on_unexpected(request, exc: Exception):
        return error_response(exc)
