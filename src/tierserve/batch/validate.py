"""Checking batch input files: at upload (each line a JSON object, within the limits) and
when a batch is created (each line a request for the batch's endpoint).

A file that breaks the format fails as a whole before any line runs; the messages name
the line (1-based, counting every line of the file). What is inside a request's `body`
is checked when the line runs, so one bad body fails alone (as the same request over
HTTP would have).
"""

import json
from pathlib import Path

from tierserve.errors import InvalidRequestError

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
WINDOWS = {"24h": 24 * 3600}
MAX_ERRORS = 20
"""Validation errors reported per file; the first is the one in the message."""


def check_upload(path: Path, max_lines: int) -> int:
    """The number of requests in an uploaded batch file; InvalidRequestError (with the
    line number) if a line is not a JSON object or there are too many."""
    count = 0
    for number, text in _lines(path):
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise InvalidRequestError(f"line {number} is not valid JSON ({exc.msg})",
                                      param="file") from None
        if not isinstance(obj, dict):
            raise InvalidRequestError(f"line {number} is not a JSON object", param="file")
        count += 1
        if count > max_lines:
            raise InvalidRequestError(f"the file has more than {max_lines} requests (line "
                                      f"{number}); split it into several batches", param="file")
    if count == 0:
        raise InvalidRequestError("the file has no requests", param="file")
    return count


def parse_requests(path: Path, endpoint: str,
                   max_lines: int) -> tuple[list[tuple[str, dict]], list[dict]]:
    """(custom_id, body) per request line, and the validation errors (OpenAI's shape:
    code, message, param, line); any error means the batch fails without running."""
    requests, errors, seen = [], [], {}

    def error(number: int, code: str, message: str, param: str | None = None) -> None:
        if len(errors) < MAX_ERRORS:
            errors.append({"code": code, "message": f"line {number}: {message}",
                           "param": param, "line": number})

    try:
        numbered = list(_lines(path))
    except (OSError, UnicodeDecodeError) as exc:
        return [], [{"code": "invalid_file", "message": f"cannot read the input file: {exc}",
                     "param": "input_file_id", "line": None}]
    if not numbered:
        error(1, "empty_file", "the input file has no requests")
    if len(numbered) > max_lines:
        error(numbered[max_lines][0], "too_many_requests",
              f"more than {max_lines} requests; split the file")
        return [], errors
    for number, text in numbered:
        try:
            obj = json.loads(text)
        except ValueError as exc:
            error(number, "invalid_json_line", f"not valid JSON ({exc.msg})")
            continue
        if not isinstance(obj, dict):
            error(number, "invalid_request", "not a JSON object")
            continue
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            error(number, "missing_required_parameter", "custom_id must be a non-empty string",
                  "custom_id")
        elif custom_id in seen:
            error(number, "duplicate_custom_id", f"custom_id {custom_id!r} is also on line "
                  f"{seen[custom_id]}", "custom_id")
        else:
            seen[custom_id] = number
        if obj.get("method") != "POST":
            error(number, "invalid_method", f"method must be POST, got {obj.get('method')!r}",
                  "method")
        if obj.get("url") != endpoint:
            error(number, "mismatched_endpoint", f"url {obj.get('url')!r} is not the batch's "
                  f"endpoint {endpoint}", "url")
        if not isinstance(obj.get("body"), dict):
            error(number, "invalid_body", "body must be a JSON object", "body")
        if not errors:
            requests.append((custom_id, obj["body"]))
    return ([] if errors else requests), errors


def _lines(path: Path):
    """(1-based line number, text) of each non-blank line."""
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            if text.strip():
                yield number, text
