"""Property-based fuzzing of every route in the OpenAPI document the server serves, with
schemathesis, on the real default model through real HTTP on 127.0.0.1.

Properties: no 5xx, and every 4xx body is OpenAI's error shape
`{"error": {"message": str, "type": str, "param": ..., "code": ...}}` (streamed errors too).

NOTE: reaching the engine
    Drawn at random, a model name, a file id or a batch id is never one the server knows,
    and such a case stops at a 404 before the engine. So the schema's hooks pin `model` to
    the served name and draw ids from objects this test made first (an uploaded file, a
    batch made from it); a DELETE gets a fresh file of its own. `max_tokens`,
    `max_completion_tokens` and `n` are capped (max_tokens set when neither is given) so
    each case costs one short generation. Everything else is as schemathesis generates it, valid and invalid.
    The test counts the cases that reached a model step and insists they are a fair share.

Bounded: EXAMPLES cases per operation and mode, and BUDGET_S seconds for all of them
(the file takes about 70 s on 2 cores, the model load included). TIERSERVE_FUZZ_SEED picks another run.
"""

import collections
import io
import json
import os
import time

import httpx
import pytest
import requests

from test_server import MODEL, LiveServer
from tierserve.server.settings import ServerSettings

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

SEED = int(os.environ.get("TIERSERVE_FUZZ_SEED", "0"))
EXAMPLES = {"POST /v1/chat/completions": 50, "POST /v1/completions": 50}
"""Cases per operation and generation mode; the rest get DEFAULT_EXAMPLES."""
DEFAULT_EXAMPLES = 10
BUDGET_S = 90.0
"""Seconds for all cases, shared out by examples, a valid completion case counting SLOW
(what a run leaves goes to the next); cases drawn past a run's share are not sent."""
SLOW = 4
MAX_TOKENS, MAX_N = 4, 2
MODEL_ROUTES = ("POST /v1/chat/completions", "POST /v1/completions")
FILE_LINE = {"custom_id": "fuzz-0", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": MODEL, "max_tokens": 2,
                      "messages": [{"role": "user", "content": "hi"}]}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    srv = LiveServer(ServerSettings(
        data_dir=str(root / "data"), ledger=str(root / "ledger.db"), max_body_bytes=64 * 1024,
        max_n=4, max_file_bytes=64 * 1024, max_batch_lines=8))
    yield srv
    srv.stop()


def upload(url: str) -> str:
    r = httpx.post(url + "/v1/files", data={"purpose": "batch"}, timeout=30,
                   files={"file": ("fuzz.jsonl", io.BytesIO(json.dumps(FILE_LINE).encode()))})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def bound_schema(url: str):
    """The served OpenAPI document, with hooks that bind names and ids and cap the work."""
    file_id = upload(url)
    r = httpx.post(url + "/v1/batches", timeout=30, json={
        "input_file_id": file_id, "endpoint": "/v1/chat/completions",
        "completion_window": "24h"})
    assert r.status_code == 200, r.text
    ids = {"file_id": file_id, "batch_id": r.json()["id"], "model_id": MODEL}
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    schema.config.output.sanitization.enabled = False  # it hides `max_tokens` in curl lines

    @schema.hook("map_case")
    def bind(context, case):
        if case.path_parameters:
            case.path_parameters = {**case.path_parameters,
                                    **{k: ids[k] for k in case.path_parameters if k in ids}}
        if isinstance(case.body, dict):
            body = dict(case.body)
            if "model" in body:
                body["model"] = MODEL
            if "input_file_id" in body:
                body["input_file_id"] = file_id
            if f"{case.method} {case.operation.path}" in MODEL_ROUTES:
                cap(body)
            case.body = body
        return case

    return schema


def cap(body: dict) -> None:
    """Bound the generation a case asks for; a non-int (invalid) value is left to fail."""
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS
    for name, most in (("max_tokens", MAX_TOKENS), ("max_completion_tokens", MAX_TOKENS),
                       ("n", MAX_N)):
        if type(body.get(name)) is int:
            body[name] = min(body[name], most)


def problems_of(response) -> list[str]:
    """What breaks the properties in one response (empty: none)."""
    status = response.status_code
    if status >= 500:
        return [f"{status}: {response.content[:300]!r}"]
    ctype = ";".join(response.headers.get("content-type", []))
    if status < 400:
        if "text/event-stream" not in ctype:
            return []
        events = [line[6:] for line in response.content.decode().splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        return [f"streamed {e[:300]}" for e in events
                if "error" in json.loads(e) and not openai_error(json.loads(e), 400)]
    try:
        body = response.json()
    except ValueError:
        return [f"{status} is not JSON: {response.content[:300]!r}"]
    return [] if openai_error(body, status) else [f"{status} not OpenAI's shape: {body}"]


def openai_error(body, status: int) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return (isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
            and isinstance(error["message"], str) and isinstance(error["type"], str)
            and (status < 500 and error["type"] != "server_error"))


HUGE = 2**70
FOUND = [
    # (path, body fields, param): 500s found by the fuzzer, or by probing around what it
    # found, that are now 400s
    ("/v1/chat/completions", {"seed": HUGE}, "seed"),
    ("/v1/chat/completions", {"seed": -HUGE, "stream": True}, "seed"),
    ("/v1/chat/completions", {"top_k": HUGE}, "top_k"),
    ("/v1/chat/completions", {"priority": HUGE}, "priority"),
    ("/v1/chat/completions", {"logit_bias": {str(HUGE): 1}}, "logit_bias"),
    ("/v1/chat/completions", {"stop_token_ids": [HUGE]}, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]},
     "messages.0.content"),
    ("/v1/chat/completions", {"metadata": {"\udfff": "x"}}, "metadata"),
    ("/v1/completions", {"prompt": [-HUGE, -1], "echo": True}, "prompt"),
    ("/v1/completions", {"prompt": [[2**40]], "echo": True}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "\ud800"]}, "prompt.1"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/v1/batches", {"input_file_id": "\ud800", "endpoint": "/v1/completions",
                     "completion_window": "24h"}, "input_file_id"),
]


@pytest.mark.parametrize("path,fields,param", FOUND)
def test_what_the_fuzzer_found_is_a_400(server, path, fields, param):
    body = {"model": MODEL, "max_tokens": 2, **({"messages": [{"role": "user", "content": "hi"}]}
                                                if path == "/v1/chat/completions" else {}),
            **({"prompt": "hi"} if path == "/v1/completions" else {}), **fields}
    if path == "/v1/batches":
        body = fields
    # json.dumps writes a lone surrogate as its escape, as a client would send it
    r = httpx.post(server.url + path, content=json.dumps(body),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert openai_error(r.json(), 400) and r.json()["error"]["param"].startswith(param)


def test_a_batch_file_that_is_not_unicode_is_a_400(server):
    for content, param in [(b"\xc6\n", "file"), (json.dumps({**FILE_LINE, "custom_id": "\ud800"})
                                                     .encode(), "input_file_id")]:
        r = httpx.post(server.url + "/v1/files", data={"purpose": "batch"}, timeout=30,
                       files={"file": ("x.jsonl", io.BytesIO(content))})
        if r.status_code == 200:
            r = httpx.post(server.url + "/v1/batches", timeout=30, json={
                "input_file_id": r.json()["id"], "endpoint": "/v1/chat/completions",
                "completion_window": "24h"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_fuzz_every_operation(server):
    """No 5xx and OpenAI-shaped errors on every operation; a fair share reaches the model."""
    start = time.monotonic()
    schema = bound_schema(server.url)
    operations = [result.ok() for result in schema.get_all_operations()]
    runs = [(op, f"{op.method.upper()} {op.path}", mode) for op in operations
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
    examples = {label: EXAMPLES.get(label, DEFAULT_EXAMPLES) for _, label, _ in runs}

    def cost(label, mode) -> int:  # a valid completion case runs the model: the slow ones
        slow = label in MODEL_ROUTES and mode == GenerationMode.POSITIVE
        return examples[label] * (SLOW if slow else 1)

    left = sum(cost(label, mode) for _, label, mode in runs)
    session = requests.Session()
    found: list[str] = []
    sent = collections.Counter()  # (mode, "cases" | "model cases" | "model steps")
    unsent = collections.Counter()  # label (mode): cases drawn past the run's share of time

    def sender(mode: str, deadline: float):
        def send(case):
            label = f"{case.method} {case.operation.path}"
            if time.monotonic() > deadline:
                unsent[f"{label} ({mode})"] += 1
                return
            if case.method == "DELETE" and "file_id" in case.path_parameters:
                case.path_parameters = {**case.path_parameters, "file_id": upload(server.url)}
            response = case.call(session=session, timeout=60)
            sent[mode, "cases"] += 1
            if label in MODEL_ROUTES:
                sent[mode, "model cases"] += 1
                sent[mode, "model steps"] += response.status_code == 200
            found.extend(f"{label} ({mode}): {p}\n    {case.as_curl_command()}"
                         for p in problems_of(response))
        return send

    for operation, label, mode in runs:  # each its share of the time left
        now = time.monotonic()
        deadline = now + (start + BUDGET_S - now) * cost(label, mode) / left
        left -= cost(label, mode)
        run = settings(max_examples=examples[label], deadline=None, database=None,
                       phases=[Phase.generate], suppress_health_check=list(HealthCheck))(
            given(case=operation.as_strategy(mode))(sender(mode.value, deadline)))
        try:
            seed(SEED)(run)()
        except Unsatisfiable:  # nothing to make invalid (no parameters, no body)
            assert mode == GenerationMode.NEGATIVE, label
    steps, cases = sent["positive", "model steps"], sent["positive", "model cases"]
    print(f"\nfuzz: schemathesis {schemathesis.__version__}, seed {SEED}, {len(operations)} "
          f"operations, {sent['positive', 'cases']} valid and {sent['negative', 'cases']} "
          f"invalid cases sent in {time.monotonic() - start:.0f} s (past the budget, not "
          f"sent: {dict(unsent)}); "
          f"reached a model step: {steps} of {cases} valid and "
          f"{sent['negative', 'model steps']} of {sent['negative', 'model cases']} invalid "
          f"completion cases; {len(found)} problems")
    assert not found, "\n".join(found[:20])
    assert steps > 0 and steps >= 0.3 * cases, "too few cases reached the engine"
