"""Hybrid serving through real HTTP: two in-process engines behind one server, an alias
whose rules pick the model and the tier per request, and the ledger recording both.

Both engines run the default model (a second engine of it named `large`): what is under
test is the choice and its accounting, not the second model's quality."""

import json
import sqlite3

import httpx
import pytest

from conftest import get_engine
from test_server import MODEL, LiveServer
from tierserve.engine.async_engine import AsyncEngine
from tierserve.route.conversations import workload
from tierserve.route.rules import parse_routes
from tierserve.router.local import LocalBackend
from tierserve.server.settings import ServerSettings

ROUTES = {"assistant": [
    {"name": "greeting", "when": {"turns_max": 1, "prompt_tokens_max": 60}, "model": MODEL,
     "tier": "priority"},
    {"name": "ticket", "when": {"regex": "(?i)refund|invoice"}, "model": "large",
     "tier": "default"},
    {"name": "learned", "when": {"score_min": 0.5}, "model": "large", "tier": "default"},
    {"name": "rest", "model": MODEL, "tier": "priority"},
], "cascade": [
    {"name": "small-first", "model": MODEL, "tier": "priority",
     "escalate": {"model": "large", "tier": "default"}},
], "doubtful": [
    {"name": "small-first", "model": MODEL, "tier": "priority",
     "escalate": {"model": "large", "min_mean_logprob": 0.0, "on_length": False}},
]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tierserve.cli import main

    root = tmp_path_factory.mktemp("hybrid")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in workload(300, seed=2)))
    assert main(["route", "train", "--data", str(data), "--out", str(root / "r.joblib")]) == 0
    settings = ServerSettings(ledger=str(root / "ledger.db"), data_dir=str(root / "data"),
                              routes=parse_routes(ROUTES, {MODEL, "large"}),
                              route_classifier=str(root / "r.joblib"))
    srv = LiveServer(settings, max_num_seqs=8)
    large = AsyncEngine(get_engine(max_num_seqs=6))
    srv.app.state.tierserve.attach(LocalBackend(large, "large"), "large")
    srv.ledger = root / "ledger.db"
    yield srv
    srv.stop()


def chat(srv, messages, stream=False, headers=None, model="assistant", max_tokens=4):
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "messages": messages}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120,
                      headers=headers or {})


def user(*texts):
    out = []
    for i, t in enumerate(texts):
        if i:
            out.append({"role": "assistant", "content": "I see."})
        out.append({"role": "user", "content": t})
    return out


def rows(srv) -> dict[str, tuple]:
    with sqlite3.connect(srv.ledger) as db:
        return {r[0]: (r[1], json.loads(r[2]).get("route"), r[3]) for r in db.execute(
            "SELECT request_id, model, tags, tier_served FROM requests")}


def test_each_rule_sends_its_requests_to_its_model_and_tier_and_the_ledger_says_so(server):
    cases = [(user("Hi!"), "assistant/greeting", MODEL, "priority"),
             (user("Hello", "I want a refund for order 123"), "assistant/ticket", "large",
              "default"),
             (user("My e-bike battery won't hold a charge", "I tried that, it still slips "
                   "under load."), "assistant/learned", "large", "default"),
             (user("Thanks, that's all.", "What are your opening hours on Sunday? " * 6),
              "assistant/rest", MODEL, "priority")]
    ids = {}
    for messages, route, model, tier in cases:
        r = chat(server, messages)
        assert r.status_code == 200, r.text
        assert r.headers["x-tierserve-route"] == f"route={route}; model={model}"
        assert r.json()["model"] == model and r.json()["service_tier"] == tier
        ids[r.json()["id"]] = (model, route, tier)
    ledger = rows(server)
    for rid, expected in ids.items():
        assert ledger[rid] == expected


def test_a_model_called_by_name_is_served_as_asked_with_no_route(server):
    r = chat(server, user("Hi!"), model="large")
    assert r.status_code == 200 and r.json()["model"] == "large"
    assert "x-tierserve-route" not in r.headers
    assert rows(server)[r.json()["id"]] == ("large", None, "default")


def test_a_stream_sent_to_the_batched_tier_opens_with_a_comment_and_a_notice_if_asked(server):
    plain = chat(server, user("Hello", "refund please"), stream=True).text
    assert plain.startswith(": routed to large in the default tier (assistant/ticket)")
    assert "event: tierserve.route" not in plain and plain.rstrip().endswith("[DONE]")
    asked = chat(server, user("Hello", "refund please"), stream=True,
                 headers={"x-tierserve-notice": "1"}).text
    event = asked.split("\n\n")[1]
    assert event.startswith("event: tierserve.route\ndata: ")
    assert json.loads(event.split("data: ", 1)[1])["notice"] == "thinking"
    fast = chat(server, user("Hi!"), stream=True, headers={"x-tierserve-notice": "1"}).text
    assert fast.startswith("data: ")  # the fast lane answers at once: nothing to announce


def test_the_model_list_names_models_and_aliases_and_unknown_names_are_404(server):
    data = httpx.get(server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in data] == [MODEL, "large", "assistant", "cascade", "doubtful"]
    assert data[2]["routes_to"] == sorted([MODEL, "large"])
    r = chat(server, user("Hi!"), model="medium")
    assert r.status_code == 404 and "`assistant`" in r.json()["error"]["message"]


def test_metrics_carry_each_model_as_its_label(server):
    chat(server, user("Hello", "invoice question"))
    text = httpx.get(server.url + "/metrics").text
    assert 'tierserve_generation_tokens_total{model="large",tier="default"}' in text
    assert 'vllm:num_requests_running{engine="0",model_name="large"}' in text


def test_bill_by_route_compares_each_route_with_the_large_model_in_the_fast_lane(server,
                                                                                 capsys):
    from tierserve.cli import main

    for i in range(6):  # the basis of the estimate: the large model's own fast lane
        body = {"model": "large", "max_tokens": 3 + i, "temperature": 0,
                "service_tier": "priority", "messages": user(f"Hello {i}", "refund? " * i)}
        assert httpx.post(server.url + "/v1/chat/completions", json=body,
                          timeout=120).status_code == 200
    assert chat(server, user("Hi!")).status_code == 200
    capsys.readouterr()
    assert main(["bill", "--ledger", str(server.ledger), "--by", "route", "--large", "large",
                 "--format", "json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    groups = {g["route"]: g for g in summary["groups"]}
    assert "assistant/greeting" in groups and "large (by name)" in groups
    assert summary["large"]["basis_requests"] >= 6
    for g in groups.values():
        assert g["if_large_priority"] > 0
    assert any("in the priority tier they would have cost" in f for f in summary["findings"])
    assert main(["bill", "--ledger", str(server.ledger), "--by", "route"]) == 0
    assert "if_large_priority" in capsys.readouterr().out


def test_an_answer_cut_by_length_escalates_to_the_large_model_and_both_are_billed(server):
    r = chat(server, user("Tell me a long story about bikes."), model="cascade", max_tokens=3)
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    assert rid.endswith("-escalated") and r.json()["model"] == "large"
    assert r.headers["x-tierserve-route"] == \
        f"route=cascade/small-first; model=large; escalated_from={MODEL} (length)"
    ledger = rows(server)
    first = rid[:-len("-escalated")]
    assert ledger[first] == (MODEL, "cascade/small-first", "priority")
    assert ledger[rid] == ("large", "cascade/small-first", "default")
    streamed = chat(server, user("Tell me a long story."), model="cascade", max_tokens=3,
                    stream=True)
    assert "large" not in streamed.text  # a stream's tokens are sent: it never escalates


def test_a_low_mean_logprob_escalates_without_showing_the_client_any_logprobs(server):
    r = chat(server, user("Hi!"), model="doubtful", max_tokens=4)
    assert r.status_code == 200 and r.json()["model"] == "large"
    assert "mean logprob -" in r.headers["x-tierserve-route"]
    assert r.json()["choices"][0]["logprobs"] is None
    asked = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": "doubtful", "max_tokens": 2, "temperature": 0, "logprobs": True,
        "messages": user("Hi!")}).json()
    assert len(asked["choices"][0]["logprobs"]["content"]) == 2  # asked for: kept
