"""The OpenAI request surface on the real default model over real HTTP: nothing is accepted
and ignored (unknown and unsupported fields are 400s naming the field), the sampling fields
do what they say, and vLLM's utility routes answer as vLLM's do."""

import json
import time

import httpx
import pytest

from test_server import MODEL, LiveServer
from tierserve.server.settings import ServerSettings

openai = pytest.importorskip("openai")
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    db = tmp_path_factory.mktemp("ledger") / "l.db"
    srv = LiveServer(ServerSettings(ledger=str(db), machine_price_per_hour=1.0))
    srv.ledger_path = db
    yield srv
    srv.stop()


REFUSED = [
    # (endpoint, extra fields, param, code)
    ("chat", {"frobnicate": 1}, "frobnicate", "unknown_parameter"),
    ("chat", {"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
    ("chat", {"audio": {"voice": "alloy"}}, "audio", "unsupported_parameter"),
    ("chat", {"top_logprobs": 2}, "top_logprobs", None),
    ("chat", {"logprobs": True, "top_logprobs": 50}, "top_logprobs", None),
    ("chat", {"reasoning_effort": "high"}, "reasoning_effort", "unsupported_parameter"),
    ("chat", {"stream_options": {"include_usage": True, "extra": 1}}, "stream_options",
     "unknown_parameter"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages",
     None),
    ("chat", {"presence_penalty": 3}, "presence_penalty", None),
    ("chat", {"logit_bias": {"999999": 5}}, "logit_bias", None),
    ("completion", {"best_of": 3}, "best_of", "unsupported_parameter"),
    ("completion", {"suffix": "end"}, "suffix", "unsupported_parameter"),
    ("completion", {"logprobs": 2, "echo": True}, "logprobs", "unsupported_parameter"),
    ("completion", {"echo": True, "frobnicate": 1}, "frobnicate", "unknown_parameter"),
]


@pytest.mark.parametrize("kind,extra,param,code", REFUSED)
def test_unknown_and_unsupported_fields_are_400s_naming_the_field(server, kind, extra, param,
                                                                  code):
    body = {"model": MODEL, "max_tokens": 2,
            **({"messages": HI} if kind == "chat" else {"prompt": "hi"}), **extra}
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"].startswith(param)
    assert param in err["message"]
    if code:
        assert err["code"] == code


def test_fields_that_ask_for_nothing_are_accepted(server):
    """What SDKs send by default (empty tools, logprobs false, store false, text format)."""
    r = server.client().chat.completions.create(
        model=MODEL, messages=HI, max_tokens=2, tools=[], logprobs=False, store=False,
        response_format={"type": "text"}, parallel_tool_calls=True, modalities=["text"])
    assert r.choices[0].message.content is not None
    details = r.usage.completion_tokens_details
    assert details is not None and details.reasoning_tokens == 0


def test_developer_messages_act_as_system(server):
    def answer(role):
        return server.client().chat.completions.create(
            model=MODEL, temperature=0, max_tokens=12, messages=[
                {"role": role, "content": "You only answer in French."},
                {"role": "user", "content": "What colour is the sky?"}]).choices[0].message.content
    assert answer("developer") == answer("system")


def test_the_response_id_is_the_ledgers_request_id(server):
    from tierserve.metering.ledger import connect
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": HI, "max_tokens": 3, "n": 2, "user": "user-7"})
    rid = r.json()["id"]
    assert r.headers["x-request-id"] == rid
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}) as s:
        sid = s.headers["x-request-id"]
        ids = {json.loads(x[6:])["id"] for x in s.iter_lines() if x.startswith("data: {")}
    assert ids == {sid}
    server.wait_idle()
    deadline = time.time() + 10  # the ledger commits every 0.25 s
    while True:
        rows = dict(connect(server.ledger_path).execute(
            "SELECT request_id, tags FROM requests").fetchall())
        if sid in rows or time.time() > deadline:
            break
        time.sleep(0.1)
    assert json.loads(rows[rid]) == {"user": "user-7"} and f"{rid}-1" in rows and sid in rows


def test_version_model_tokenize_and_detokenize(server):
    assert httpx.get(server.url + "/version").json()["version"]
    assert httpx.get(server.url + f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert httpx.get(server.url + "/v1/models/gpt-9").status_code == 404
    tok = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "Hello world",
                                                     "add_special_tokens": False}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] > 0
    back = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": tok["tokens"]})
    assert back.json() == {"prompt": "Hello world"}
    chat = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": HI}).json()
    r = server.client().chat.completions.create(model=MODEL, messages=HI, max_tokens=1)
    assert chat["count"] == r.usage.prompt_tokens
    bad = httpx.post(server.url + "/tokenize", json={"model": MODEL})
    assert bad.status_code == 400
    assert httpx.post(server.url + "/detokenize",
                      json={"model": MODEL, "tokens": [-1]}).status_code == 400


def test_echo_puts_the_prompt_ahead_whole_and_streamed(server):
    c = server.client()
    r = c.completions.create(model=MODEL, prompt="The sea is", max_tokens=4, echo=True,
                             temperature=0)
    plain = c.completions.create(model=MODEL, prompt="The sea is", max_tokens=4, temperature=0)
    assert r.choices[0].text == "The sea is" + plain.choices[0].text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt="The sea is", max_tokens=4, echo=True, temperature=0, stream=True)
        if ch.choices)
    assert streamed == r.choices[0].text


def test_penalties_and_logit_bias_change_the_output_as_specified(server):
    c = server.client()
    story = [{"role": "user", "content": "Repeat the word 'cat' forever."}]

    def tokens(extra=None, temperature=0.0, **kw):
        text = c.chat.completions.create(model=MODEL, messages=story, max_tokens=40,
                                         temperature=temperature, extra_body={"ignore_eos": True,
                                                                    **(extra or {})},
                                         **kw).choices[0].message.content
        return httpx.post(server.url + "/tokenize", json={
            "model": MODEL, "prompt": text, "add_special_tokens": False}).json()["tokens"]

    plain = tokens()
    assert len(set(tokens(frequency_penalty=2.0))) > len(set(plain))
    assert len(set(tokens(presence_penalty=2.0))) > len(set(plain))
    banned = tokens(logit_bias={str(plain[0]): -100})
    assert banned[0] != plain[0]
    assert len(set(tokens({"repetition_penalty": 1.8}))) > len(set(plain))
    # min_p 1 keeps only the most likely token: sampling at temperature 1 is greedy
    assert tokens({"min_p": 1.0}, temperature=1.0, seed=5) == plain


def test_logprobs_chat_and_completions_whole_and_streamed(server):
    c = server.client()
    r = c.chat.completions.create(model=MODEL, messages=HI, max_tokens=5, temperature=0,
                                  logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:  # greedy: the chosen token is the most likely one
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob) and t.logprob <= 0
        assert bytes(t.bytes).decode() == t.token
    streamed = [ch.choices[0].logprobs for ch in c.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
        stream=True) if ch.choices and ch.choices[0].logprobs]
    assert [t.logprob for lp in streamed for t in lp.content] == pytest.approx(
        [t.logprob for t in content], abs=1e-4)
    assert c.chat.completions.create(model=MODEL, messages=HI, max_tokens=2).choices[0] \
        .logprobs is None
    p = c.completions.create(model=MODEL, prompt="The sea is", max_tokens=4, logprobs=2,
                             temperature=0).choices[0].logprobs
    assert len(p.tokens) == len(p.token_logprobs) == len(p.top_logprobs) == 4
    assert p.text_offset[0] == 0 and all(len(x) == 2 for x in p.top_logprobs)


def test_structured_output_follows_the_schema_whole_and_streamed(server):
    """A schema with nested objects, enums and arrays, sampled at temperature 1 with several
    seeds: every output parses and conforms; the same request streamed gives the same
    text; an unconstrained request beside it is unaffected."""
    from test_grammar import NESTED_SCHEMA, conforms
    c = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": NESTED_SCHEMA,
                                                  "strict": True}}
    ask = [{"role": "user", "content": "Describe a pet as JSON."}]
    for seed in range(3):
        r = c.chat.completions.create(model=MODEL, messages=ask, response_format=fmt,
                                      temperature=1.0, seed=seed, max_tokens=200)
        assert r.choices[0].finish_reason == "stop"
        assert conforms(json.loads(r.choices[0].message.content), NESTED_SCHEMA)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=MODEL, messages=ask, response_format=fmt, temperature=1.0, seed=2,
        max_tokens=200, stream=True) if ch.choices)
    assert streamed == r.choices[0].message.content
    # (greedy, "Describe a pet as JSON." loops in an array of numbers under compact JSON:
    # this 135M model's own failure, which free whitespace avoided by chance)
    obj = c.chat.completions.create(model=MODEL, max_tokens=100, temperature=0, messages=[
        {"role": "user", "content": "Give a JSON object with a pet's name and age."}],
        response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    choice = c.completions.create(model=MODEL, prompt="The best pet is a", max_tokens=10,
                                  extra_body={"guided_choice": ["cat", "dog", "bird"]})
    assert choice.choices[0].text in ("cat", "dog", "bird")


def test_a_bad_schema_is_a_400(server):
    for extra, param in [({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objekt"}}}}, "response_format"),
                         ({"response_format": {"type": "yaml"}}, "response_format"),
                         ({"guided_regex": "(unclosed"}, "guided_regex"),
                         ({"response_format": {"type": "json_object"}, "ignore_eos": True},
                          "ignore_eos")]:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": HI, "max_tokens": 4, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 10}}, "required": ["zone"]}}}


def test_named_and_required_tool_choices_always_give_parseable_calls(server):
    from test_grammar import conforms
    c = server.client()
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    for seed in range(3):
        r = c.chat.completions.create(
            model=MODEL, messages=ask, tools=[WEATHER, TIME], temperature=1.0, seed=seed,
            max_tokens=120, tool_choice={"type": "function", "function": {"name": "get_weather"}})
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        call = ch.message.tool_calls[0]
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        assert conforms(json.loads(call.function.arguments),
                        WEATHER["function"]["parameters"])
    r = c.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, TIME],
                                  tool_choice="required", parallel_tool_calls=False,
                                  temperature=0, max_tokens=120)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "get_time")
    json.loads(calls[0].function.arguments)
    # streamed as OpenAI streams calls: index, id, name and arguments in the deltas
    deltas = [ch.choices[0] for ch in c.chat.completions.create(
        model=MODEL, messages=ask, tools=[WEATHER], tool_choice="required", temperature=0,
        max_tokens=120, stream=True) if ch.choices]
    streamed = [t for d in deltas if d.delta.tool_calls for t in d.delta.tool_calls]
    assert streamed and streamed[0].function.name == "get_weather"
    assert deltas[-1].finish_reason == "tool_calls"
    # the round trip: the call and its result in the history, then an answer
    history = ask + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": calls[0].id, "type": "function", "function": {
            "name": calls[0].function.name, "arguments": calls[0].function.arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temp": 18}'}]
    answer = c.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, TIME],
                                       tool_choice="none", max_tokens=20, temperature=0)
    assert answer.choices[0].message.content and answer.choices[0].finish_reason != \
        "tool_calls"


def test_tool_fields_are_checked(server):
    for extra, param in [({"tool_choice": "required"}, "tool_choice"),
                         ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                                               "function": {"name": "nope"}}},
                          "tool_choice"),
                         ({"tools": [{"type": "retrieval"}]}, "tools"),
                         ({"tools": [WEATHER], "tool_choice": "required",
                           "response_format": {"type": "json_object"}}, "tool_choice")]:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": HI, "max_tokens": 4, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.text
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "hi", "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"


def test_litellm_sdk_as_a_client_structured_output_and_a_tool_round_trip(server):
    """LiteLLM's SDK (the `openai/` provider pointed at us): a schema-constrained answer,
    a tool call and its result sent back; usage.cost is the number LiteLLM reads."""
    litellm = pytest.importorskip("litellm")
    from test_grammar import NESTED_SCHEMA, conforms
    kw = dict(model=f"openai/{MODEL}", api_base=server.url + "/v1", api_key="none",
              temperature=0, max_tokens=200)
    ask = [{"role": "user", "content": "Describe a pet as JSON."}]
    r = litellm.completion(messages=ask, response_format={
        "type": "json_schema", "json_schema": {"name": "pet", "schema": NESTED_SCHEMA}}, **kw)
    assert conforms(json.loads(r.choices[0].message.content), NESTED_SCHEMA)
    assert isinstance(r.usage.cost, float) and r.usage.cost > 0
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    t = litellm.completion(messages=weather, tools=[WEATHER], tool_choice="required", **kw)
    call = t.choices[0].message.tool_calls[0]
    assert t.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    history = weather + [t.choices[0].message.model_dump(exclude_none=True), {
        "role": "tool", "tool_call_id": call.id, "content": '{"temp": 18}'}]
    answer = litellm.completion(messages=history, tools=[WEATHER], tool_choice="none", **kw)
    assert answer.choices[0].message.content
