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

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
