"""What a newcomer gets without asking: the model's sampling defaults, the README's first
example answered short and right, 503 with Retry-After while loading, compact JSON, one
tool call where one was asked for."""

import json

import httpx
import pytest

from tierserve.errors import ConfigError, InvalidRequestError
from tierserve.model.generation import generation_defaults
from tierserve.server.protocol import ChatCompletionRequest
from tierserve.structured import GrammarSpec

openai = pytest.importorskip("openai")


def test_generation_defaults_come_from_the_model_and_the_flag(default_model_path, tmp_path):
    found, source = generation_defaults("auto", str(default_model_path), "Smollm2 135M")
    assert found == {"temperature": 0.2, "top_p": 0.9, "max_tokens": 256}
    assert "SmolLM2" in source
    assert generation_defaults("vllm", str(default_model_path))[0] == {}
    assert generation_defaults("auto", None)[0] == {}  # dummy weights
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_k": 20, "max_new_tokens": 64, "do_sample": True,
         "eos_token_id": 2}))
    own, _ = generation_defaults("auto", str(tmp_path / "model.gguf"))  # beside the weights
    assert own == {"temperature": 0.6, "top_k": 20, "max_tokens": 64}
    assert generation_defaults(str(tmp_path), None)[0] == own
    with pytest.raises(ConfigError, match="no generation_config.json"):
        generation_defaults(str(tmp_path / "nowhere"), None)


def test_a_request_s_own_values_win_and_what_it_left_out_is_named():
    d = {"temperature": 0.2, "top_p": 0.9, "max_tokens": 64}
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    p = body.sampling_params(0, d)
    assert (p.temperature, p.top_p, p.max_tokens, p.top_k) == (0.2, 0.9, 64, 0)
    assert {"temperature", "top_p", "max_tokens", "top_k"} <= p.defaulted
    own = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                temperature=1.0, max_completion_tokens=5)
    q = own.sampling_params(0, d)
    assert (q.temperature, q.top_p, q.max_tokens) == (1.0, 0.9, 5)
    assert "temperature" not in q.defaulted and "max_tokens" not in q.defaulted
    assert body.sampling_params(0).temperature == 1.0  # no defaults: OpenAI's


@pytest.fixture(scope="module")
def server():
    from test_server import LiveServer
    from tierserve.server.settings import ServerSettings
    # the engine as `make serve` builds it: defaults on, bfloat16 with the GGUF's 4-bit weights
    srv = LiveServer(ServerSettings(), dtype="bfloat16", quantization="gguf")
    yield srv
    srv.stop()


def test_the_readme_s_first_example_answers_short_and_right(server):
    """The README's first example (temperature 0, no max_tokens), against the weights `make
    serve` serves, says Paris and stops; with nothing given at all the model's defaults
    bound the answer (OpenAI's temperature 1 and no cap once ran 169 s to the context's
    end)."""
    ask = [{"role": "user", "content": "Name the capital of France."}]
    r = server.client().chat.completions.create(model="smol", messages=ask, temperature=0)
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert "Paris" in r.choices[0].message.content and r.usage.completion_tokens < 32
    bare = server.client().chat.completions.create(model="smol", messages=ask)
    assert bare.usage.completion_tokens <= 256


def test_json_comes_out_compact_unless_a_layout_is_allowed(server):
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "tags": {
            "type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
        "required": ["name", "tags"], "additionalProperties": False}
    ask = [{"role": "user", "content": "Describe a cat as JSON with a few tags."}]
    r = server.client().chat.completions.create(
        model="smol", messages=ask, max_tokens=80, temperature=0, response_format={
            "type": "json_schema", "json_schema": {"name": "cat", "schema": schema}})
    text = r.choices[0].message.content
    value = json.loads(text)
    assert text == json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    laid_out = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": "smol", "messages": ask, "max_tokens": 80, "temperature": 0,
        "structured_outputs": {"json": schema, "whitespace_pattern": "[ ]{1}"}}).json()
    spaced = laid_out["choices"][0]["message"]["content"]
    assert json.loads(spaced) and ": " in spaced  # one space at each gap, as asked
    bad = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": "smol", "messages": ask, "max_tokens": 8,
        "structured_outputs": {"regex": "a+", "whitespace_pattern": " "}})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "structured_outputs.whitespace_pattern"


def test_whitespace_pattern_rides_to_a_replica_and_keys_the_cache():
    schema = {"type": "object"}
    spec = GrammarSpec.from_request(structured_outputs={"json": schema,
                                                        "whitespace_pattern": " ?"})
    assert spec.whitespace == " ?" and spec != GrammarSpec.json_schema(schema)
    assert spec.to_vllm() == {"json": schema, "whitespace_pattern": " ?"}
    assert GrammarSpec.json_schema(schema).to_vllm() == {"json": schema}
    with pytest.raises(InvalidRequestError):
        GrammarSpec.from_request(structured_outputs={"whitespace_pattern": " "})


def test_a_named_tool_gets_exactly_one_call():
    from tierserve.server import tools
    weather = {"type": "function", "function": {"name": "w", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                 tools=[weather], tool_choice={"type": "function",
                                                               "function": {"name": "w"}})
    schema = json.loads(tools.grammar(body).value)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    free = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                 tools=[weather], tool_choice="required")
    assert "maxItems" not in json.loads(tools.grammar(free).value)


def test_the_api_answers_503_with_retry_after_while_loading():
    from fastapi.testclient import TestClient

    from tierserve.server.app import create_app
    from tierserve.server.settings import ServerSettings
    app = create_app(None, ServerSettings(), "smol")
    with TestClient(app) as client:
        for path in ("/v1/models", "/v1/models/smol"):
            r = client.get(path)
            assert r.status_code == 503 and r.headers["retry-after"] == "5", path
            assert r.json()["error"]["code"] == "model_loading"
        r = client.post("/v1/completions", json={"model": "smol", "prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        assert client.get("/health").status_code == 503
