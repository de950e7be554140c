"""The user-facing error hierarchy.

Every error a user can cause is one of these types. The CLI prints `error: <message>` and
exits non-zero; the HTTP edge maps each type once to an OpenAI error body and status.
"""


class TierserveError(Exception):
    """Base class of every error tierserve raises on purpose."""


class ConfigError(TierserveError):
    """A configuration value is missing, out of range or inconsistent."""


class ModelLoadError(TierserveError):
    """Weights or tokenizer could not be loaded (missing file, corrupt header...)."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint is readable but uses an architecture or format we do not run."""


class InvalidRequestError(TierserveError):
    """A request's parameters are invalid (bad sampling values, prompt too long...)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class ContextLengthError(InvalidRequestError):
    """Prompt plus requested output exceed the model's context length."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message, param, code="context_length_exceeded")


class AuthenticationError(TierserveError):
    """Missing or unknown API key."""


class TierNotAllowedError(TierserveError):
    """The key may not use the requested tier and the server is configured strict."""


class PermissionDeniedError(TierserveError):
    """This server will not let the caller do this (403)."""

    code = "permission_denied"


class NotFoundError(TierserveError):
    """Unknown model, file, batch or route."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class ConflictError(TierserveError):
    """The object is not in a state that allows the action (cancel a finished batch)."""


class RequestTooLargeError(TierserveError):
    """The request body exceeds the configured limit."""


class OverloadedError(TierserveError):
    """A queue is full, or a flex request waited past its limit: retry later."""

    def __init__(self, message: str, retry_after_s: int = 1, code: str = "rate_limit_exceeded",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.code = code
        self.headers = dict(headers or {})
        """More response headers (a tenant's x-ratelimit-* state)."""


class UpstreamError(TierserveError):
    """A replica refused a request (fleet mode): its status and error passed on as they
    came, so a client sees what it would see from the replica itself."""

    def __init__(self, message: str, status: int, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


class ReplicaUnavailableError(TierserveError):
    """No replica could serve the request (all down, or the one serving it failed)."""

    def __init__(self, message: str, code: str = "replica_unavailable"):
        super().__init__(message)
        self.code = code


class LoadingError(TierserveError):
    """The server is up but its model (or its replicas) not yet: retry after a while."""

    def __init__(self, message: str, retry_after_s: int = 5, code: str = "model_loading"):
        super().__init__(message)
        self.retry_after_s, self.code = retry_after_s, code
