"""Typed errors to OpenAI error responses, mapped once (and nowhere else)."""

import json

from fastapi.responses import JSONResponse

from tierserve.errors import (AuthenticationError, ConflictError, ContextLengthError,
                              InvalidRequestError, LoadingError, NotFoundError, OverloadedError,
                              PermissionDeniedError, ReplicaUnavailableError, RequestTooLargeError,
                              TierNotAllowedError, UpstreamError)
from tierserve.server import openai_format as fmt

ERRORS: list[tuple[type[Exception], int, str]] = [
    # exception type, HTTP status, OpenAI error type (first match wins)
    (ContextLengthError, 400, "invalid_request_error"),
    (InvalidRequestError, 400, "invalid_request_error"),
    (AuthenticationError, 401, "invalid_request_error"),
    (TierNotAllowedError, 403, "permission_error"),
    (PermissionDeniedError, 403, "permission_error"),
    (NotFoundError, 404, "invalid_request_error"),
    (ConflictError, 409, "invalid_request_error"),
    (RequestTooLargeError, 413, "invalid_request_error"),
    (OverloadedError, 429, "rate_limit_error"),
    (LoadingError, 503, "server_error"),
    (ReplicaUnavailableError, 503, "server_error"),
]
_DEFAULT_CODES = {401: "invalid_api_key", 403: "tier_not_allowed", 404: "not_found",
                  409: "conflict", 413: "request_too_large"}


def error_body(exc: Exception) -> tuple[int, dict]:
    """(HTTP status, OpenAI error body) of an exception."""
    response = error_response(exc)
    return response.status_code, json.loads(response.body)


def error_response(exc: Exception) -> JSONResponse:
    if isinstance(exc, UpstreamError):
        otype = "invalid_request_error" if exc.status < 500 else "server_error"
        return JSONResponse(fmt.error_body(str(exc), otype, exc.param, exc.code),
                            status_code=exc.status)
    for etype, status, otype in ERRORS:
        if isinstance(exc, etype):
            code = getattr(exc, "code", None) or _DEFAULT_CODES.get(status)
            headers = ({**exc.headers, "Retry-After": str(exc.retry_after_s)}
                       if isinstance(exc, OverloadedError) else
                       {"Retry-After": str(exc.retry_after_s)}
                       if isinstance(exc, LoadingError) else None)
            body = fmt.error_body(str(exc), otype, getattr(exc, "param", None), code)
            return JSONResponse(body, status_code=status, headers=headers)
    return JSONResponse(fmt.error_body("internal error: " + str(exc), "server_error",
                                       code="internal_error"), status_code=500)


def validation_error(errors: list) -> InvalidRequestError:
    """The first of pydantic's errors as one clear message naming the parameter."""
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ())]
    if loc[:1] in (["body"], ["query"]):   # where it was, not part of its name
        loc = loc[1:]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        message, param = "the request body is not valid JSON", None
    elif first.get("type") == "extra_forbidden":  # OpenAI's words for an unknown argument
        return InvalidRequestError(f"Unrecognized request argument supplied: {param}",
                                   param=param, code="unknown_parameter")
    return InvalidRequestError(f"{param}: {message}" if param else message, param=param)
