"""The HTTP server on the real default model, through real HTTP on 127.0.0.1, with the
official `openai` client where a client is involved."""

import concurrent.futures
import json
import socket
import threading
import time

import httpx
import pytest

from conftest import get_engine
from tierserve.engine.async_engine import AsyncEngine
from tierserve.router.local import LocalBackend
from tierserve.server.app import create_app
from tierserve.server.settings import ServerSettings, Tenant
from tierserve.tiers import Tier, resolve

openai = pytest.importorskip("openai")
MODEL = "smol"


class LiveServer:
    def __init__(self, settings: ServerSettings, async_engine=None, **engine_kwargs):
        import uvicorn
        if async_engine is None:
            async_engine = AsyncEngine(get_engine(**engine_kwargs))
        self.engine = async_engine.engine
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        settings.port = self.port
        self.app = create_app(LocalBackend(async_engine), settings, MODEL)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, key="none"):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def wait_idle(self, timeout=30):
        deadline = time.time() + timeout
        while self.engine.has_unfinished_requests():
            assert time.time() < deadline, "requests still running"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def server():
    srv = LiveServer(ServerSettings(max_body_bytes=64 * 1024, max_n=4))
    yield srv
    srv.stop()


def assert_blocks_free(engine):
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


def test_chat_completion_with_openai_client(server):
    r = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=30, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and r.service_tier == "default"
    u = r.usage
    assert u.prompt_tokens > 10 and u.completion_tokens > 2
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0
    timing = r.model_extra["usage"]["timing"] if "usage" in r.model_extra else u.timing
    assert timing["decode_s"] > 0 and timing["queue_s"] >= 0


def test_streaming_chat_with_usage_chunk(server):
    stream = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count from 1 to 5."}],
        max_completion_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason in ("stop", "length")
    whole = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count from 1 to 5."}],
        max_completion_tokens=20, temperature=0)
    assert text == whole.choices[0].message.content


def test_completions_sync_stream_stop_and_seed(server):
    c = server.client()
    r = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                             temperature=0)
    text = r.choices[0].text
    assert r.object == "text_completion" and len(text) > 0
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0,
        stream=True) if ch.choices)
    assert streamed == text
    word = text.split()[0] if text.split() else text[:2]
    cut = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                               temperature=0, stop=[word])
    assert word not in cut.choices[0].text and cut.choices[0].finish_reason == "stop"
    a, b = (c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                 temperature=1.0, seed=11) for _ in range(2))
    assert a.choices[0].text == b.choices[0].text


def test_n_choices_and_extras(server):
    r = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say a word."}], n=2,
        max_tokens=6, temperature=1.0, seed=3,
        extra_body={"top_k": 20, "min_tokens": 6, "ignore_eos": True, "priority": 1})
    assert [ch.index for ch in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 12


def test_client_disconnect_aborts_and_frees_blocks(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}],
            "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = 0
            for line in resp.iter_lines():
                lines += bool(line.strip())
                if lines >= 3:
                    break
    server.wait_idle(timeout=10)
    assert_blocks_free(server.engine)
    text = httpx.get(server.url + "/metrics").text
    assert 'tierserve_request_finished_total{finish_reason="abort"' in text


BAD = [
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "model", None),
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "model", None),
    ({"model": MODEL, "messages": []}, 400, "messages", None),
    ({"model": MODEL, "messages": "hello"}, 400, "messages", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
     400, "temperature", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 7},
     400, "temperature", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
     400, "max_tokens", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6},
     400, "max_tokens", "context_length_exceeded"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 99}, 400, "n", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "service_tier": "turbo"},
     400, "service_tier", None),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, None, None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400,
     "top_p", None),
]


@pytest.mark.parametrize("payload,status,param,code", BAD)
def test_bad_inputs_get_openai_errors_and_server_keeps_serving(server, payload, status, param,
                                                               code):
    r = httpx.post(server.url + "/v1/chat/completions", json=payload, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] and err["param"].startswith(param)
    if code:
        assert err["code"] == code
    ok = httpx.post(server.url + "/v1/completions", timeout=60,
                    json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert ok.status_code == 200


def test_transport_level_errors(server):
    bad_json = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["type"]
    big = httpx.post(server.url + "/v1/completions",
                     json={"model": MODEL, "prompt": "x" * 100_000})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    assert httpx.get(server.url + "/v1/nothing").status_code == 404
    long_prompt = httpx.post(server.url + "/v1/completions", json={
        "model": MODEL, "prompt": list(range(100, 9000)), "max_tokens": 1})
    assert long_prompt.status_code == 400
    assert long_prompt.json()["error"]["code"] == "context_length_exceeded"
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = httpx.get(server.url + "/v1/models").json()
    assert models["data"][0]["id"] == MODEL


def test_metrics_parse_and_move(server):
    from prometheus_client.parser import text_string_to_metric_families

    def generated():
        text = httpx.get(server.url + "/metrics").text
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        assert "tierserve_time_to_first_token_seconds" in fams
        assert "tierserve_kv_cache_usage_ratio" in fams
        return sum(s.value for s in fams["tierserve_generation_tokens"].samples
                   if s.name.endswith("_total"))
    before = generated()
    server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=5,
                                       extra_body={"ignore_eos": True})
    server.wait_idle()
    assert generated() == before + 5


def test_overload_gets_429_with_retry_after_and_accepted_requests_finish():
    srv = LiveServer(ServerSettings(queue_limits={"default": 1}), max_num_seqs=2)
    try:
        body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 24,
                "ignore_eos": True}

        def post(_):
            return httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(post, range(8)))
        codes = sorted(r.status_code for r in results)
        assert 429 in codes and 200 in codes, codes
        for r in results:
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["code"] == "rate_limit_exceeded"
            else:
                assert r.json()["usage"]["completion_tokens"] == 24
        srv.wait_idle()
        assert_blocks_free(srv.engine)
        adm = srv.app.state.tierserve.admission
        assert sum(adm.queued.values()) == 0 and sum(adm.running.values()) == 0
    finally:
        srv.stop()


def test_api_keys_tenants_and_strict_tiers():
    keys = {"sk-a": Tenant("team-a", ["priority", "default", "flex"]),
            "sk-f": Tenant("flexers", ["flex"])}
    srv = LiveServer(ServerSettings(api_keys=keys, strict_tiers=True))
    try:
        msg = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.AuthenticationError):
            srv.client("sk-wrong").chat.completions.create(model=MODEL, messages=msg,
                                                           max_tokens=2)
        r = httpx.post(srv.url + "/v1/chat/completions", json={"model": MODEL, "messages": msg})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        ok = srv.client("sk-a").chat.completions.create(model=MODEL, messages=msg, max_tokens=2)
        assert ok.choices[0].message.content is not None
        with pytest.raises(openai.PermissionDeniedError):
            srv.client("sk-f").chat.completions.create(model=MODEL, messages=msg,
                                                       max_tokens=2, service_tier="priority")
    finally:
        srv.stop()


def test_tier_resolution_prefers_the_nearest_cheaper_allowed_tier():
    t = Tenant("t", ["default", "flex"]).allowed
    assert resolve(Tier.from_wire("priority"), t) == Tier.DEFAULT
    assert resolve(Tier.from_wire("auto"), t) == Tier.DEFAULT
    assert resolve(Tier.from_wire(None), t) == Tier.DEFAULT
    assert resolve(Tier.FLEX, Tenant("p", ["priority"]).allowed) == Tier.PRIORITY
    assert resolve(Tier.DEFAULT, Tenant("f", ["flex"]).allowed) == Tier.FLEX


def test_open_mode_refuses_a_public_address():
    from tierserve.errors import ConfigError
    with pytest.raises(ConfigError, match="loopback"):
        ServerSettings(host="0.0.0.0").validate()
    ServerSettings(host="0.0.0.0", api_keys={"k": Tenant("t")}).validate()


def test_yaml_config_keys_mirror_flags(tmp_path):
    from tierserve.cli import build_parser
    from tierserve.server.serve import build
    cfg = tmp_path / "tierserve.yaml"
    cfg.write_text(json.dumps({"max_num_seqs": 7, "port": 9001, "dtype": "float32",
                               "api_keys": {"sk-1": {"tenant": "one", "tiers": ["flex"]}},
                               "queue_limits": {"flex": 3}, "flex_max_wait_s": 5,
                               "slo": {"priority": {"ttft_s": 0.5, "tpot_s": 0.1}}}))
    parser = build_parser()
    args = parser.parse_args(["serve", "--config", str(cfg), "--port", "9002"])
    settings, config, name = build(args)
    assert config.scheduler.max_num_seqs == 7 and config.model.dtype == "float32"
    assert config.scheduler.flex_max_wait_s == 5 and config.scheduler.policy == "tiered"
    assert config.tiers.slo["priority"].tpot_s == 0.1
    assert settings.port == 9002                           # the flag given wins
    assert settings.api_keys["sk-1"].name == "one" and settings.queue_limits["flex"] == 3
    assert name == "SmolLM2-135M-Instruct"
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_num_seqz: 3\n")
    from tierserve.errors import ConfigError
    with pytest.raises(ConfigError, match="max_num_seqz"):
        build(parser.parse_args(["serve", "--config", str(bad)]))


def test_tiers_over_http_served_tier_and_flex_refusal():
    """A flex request that cannot start within its wait limit gets 429
    resource_unavailable, streamed or not; other tiers are served in their tier."""
    srv = LiveServer(ServerSettings(), flex_max_wait_s=0.0)
    try:
        msg = [{"role": "user", "content": "hi"}]
        r = srv.client().chat.completions.create(model=MODEL, messages=msg, max_tokens=3,
                                                 service_tier="priority")
        assert r.service_tier == "priority" and r.choices[0].message.content
        body = {"model": MODEL, "messages": msg, "max_tokens": 3, "service_tier": "flex"}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["code"] == "resource_unavailable" and "flex" in err["message"]
        assert int(r.headers["retry-after"]) >= 1
        with httpx.stream("POST", srv.url + "/v1/chat/completions",
                          json={**body, "stream": True}, timeout=60) as s:
            assert s.status_code == 429
        srv.wait_idle()
        text = httpx.get(srv.url + "/metrics").text
        assert 'finish_reason="refused",model="smol",tier="flex"} 2.0' in text
        adm = srv.app.state.tierserve.admission
        assert sum(adm.queued.values()) == 0 and sum(adm.running.values()) == 0
        assert_blocks_free(srv.engine)
    finally:
        srv.stop()


def test_dedicated_deployment_routes_priority_to_its_own_engine():
    from tierserve.router.dedicated import DedicatedEngines
    fast = get_engine(max_num_seqs=1, policy="fcfs")
    main = get_engine()
    srv = LiveServer(ServerSettings(), DedicatedEngines(AsyncEngine(fast), AsyncEngine(main)))
    try:
        steps = (fast.core.num_steps, main.core.num_steps)
        client = srv.client()
        msg = [{"role": "user", "content": "hi"}]
        r = client.chat.completions.create(model=MODEL, messages=msg, max_tokens=3,
                                           service_tier="priority")
        assert r.service_tier == "priority" and fast.core.num_steps > steps[0]
        assert main.core.num_steps == steps[1]
        r = client.chat.completions.create(model=MODEL, messages=msg, max_tokens=3)
        assert r.service_tier == "default" and main.core.num_steps > steps[1]
        text = httpx.get(srv.url + "/metrics").text
        assert 'tier="priority"' in text and 'tier="default"' in text
    finally:
        srv.stop()


def test_costs_in_responses_headers_metrics_and_the_ledger(tmp_path):
    from tierserve.metering.ledger import connect
    from tierserve.metering.prices import PriceList
    keys = {"sk-a": Tenant("team-a", ["priority", "default", "flex"])}
    prices = PriceList(input_per_m=1.0, cached_input_per_m=0.5, output_per_m=4.0)
    # An engine of its own: the module's `server` keeps the default engine metered too.
    srv = LiveServer(ServerSettings(api_keys=keys, ledger=str(tmp_path / "l.db"),
                                    machine_price_per_hour=36.0, prices=prices),
                     max_num_seqs=16)
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to ten."}],
                "max_tokens": 6, "ignore_eos": True, "service_tier": "priority",
                "metadata": {"feature": "search"}}
        auth = {"Authorization": "Bearer sk-a"}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, headers=auth, timeout=60)
        u = r.json()["usage"]
        cost = u["cost_details"]
        assert u["cost"] == cost["charge_usd"]  # a number, as OpenRouter and LiteLLM read it
        assert cost["currency"] == "USD" and cost["served_tier"] == "priority"
        assert cost["prefill_usd"] > 0 and cost["decode_usd"] > 0
        assert cost["machine_usd"] == pytest.approx(cost["prefill_usd"] + cost["decode_usd"])
        expected = 2.0 * ((u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"])
                          * 1.0 + u["prompt_tokens_details"]["cached_tokens"] * 0.5
                          + 6 * 4.0) / 1e6
        assert cost["charge_usd"] == pytest.approx(expected)
        assert float(r.headers["x-tierserve-charge-usd"]) == pytest.approx(expected, rel=1e-6)
        assert r.headers["x-tierserve-served-tier"] == "priority"
        # a stream's final usage chunk carries the cost too
        with httpx.stream("POST", srv.url + "/v1/chat/completions", headers=auth, timeout=60,
                          json={**body, "service_tier": "flex", "stream": True,
                                "stream_options": {"include_usage": True}}) as s:
            lines = [json.loads(x[6:]) for x in s.iter_lines()
                     if x.startswith("data: {")]
        assert lines[-1]["usage"]["cost_details"]["served_tier"] == "flex"
        # a client that leaves is billed for what ran
        with httpx.stream("POST", srv.url + "/v1/completions", headers=auth, timeout=60,
                          json={"model": MODEL, "prompt": "Once upon a time",
                                "max_tokens": 200, "ignore_eos": True, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    break
        srv.wait_idle()
        text = httpx.get(srv.url + "/metrics").text
        assert 'tierserve_machine_cost_usd_total{model="smol",phase="decode",tier="priority"}' \
            in text and "tierserve_charge_usd_total" in text
    finally:
        srv.stop()
    db = connect(tmp_path / "l.db")
    rows = db.execute("SELECT tenant, tier_requested, tier_served, finish_reason, output_tokens,"
                      " prefill_cost, decode_cost, charge, tags FROM requests ORDER BY id").fetchall()
    assert [(r[0], r[1], r[3]) for r in rows] == [
        ("team-a", "priority", "length"), ("team-a", "flex", "length"),
        ("team-a", "default", "abort")]
    assert rows[0][7] == pytest.approx(expected) and json.loads(rows[0][8]) == {"feature": "search"}
    assert 0 < rows[2][4] < 200 and rows[2][5] > 0 and rows[2][7] > 0  # the abort ran a bit


def test_idle_cost_accrues_while_the_server_is_idle_and_adds_up(tmp_path):
    """An idle server's idle cost grows between two scrapes of /metrics (and on the
    dashboard and /v1/spend) without waiting for the next step; requests plus idle still
    make up the machine cost."""
    def scraped_idle() -> float:
        text = httpx.get(srv.url + "/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("tierserve_idle_cost_usd_total{"))

    srv = LiveServer(ServerSettings(ledger=str(tmp_path / "l.db"),
                                    machine_price_per_hour=36.0), max_num_seqs=4)
    try:
        for _ in range(3):
            httpx.post(srv.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "Hello", "max_tokens": 4})
        srv.wait_idle()
        first = scraped_idle()
        time.sleep(1.0)
        second = scraped_idle()
        assert second - first == pytest.approx(36.0 / 3600, rel=0.3)  # about 1 s of idle
        board = httpx.get(srv.url + "/dashboard/data").json()["tiers"]
        assert board["idle_cost_usd"] >= second and board["idle_share"] > 0
        machine = httpx.get(srv.url + "/v1/spend").json()["machine"]
        assert machine["idle_usd"] >= board["idle_cost_usd"]
        assert machine["requests_usd"] > 0
        assert machine["requests_usd"] + machine["idle_usd"] == pytest.approx(
            machine["machine_usd"], rel=1e-9)
    finally:
        srv.stop()


def test_a_replica_in_an_inference_pool_reads_its_headers_and_exports_what_pickers_read(
        tmp_path):
    """A tierserve replica behind another project's endpoint picker: the Inference
    Extension's objective header picks the tier and its fairness id names the tenant
    (no API keys here), an objective that is no tier is a 400, and /metrics has the
    series such pickers scrape, the KV cache's shape among them."""
    import sqlite3

    srv = LiveServer(ServerSettings(ledger=str(tmp_path / "l.db")), max_num_seqs=4)
    try:
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "Hello", "max_tokens": 3}, headers={
            "x-gateway-inference-objective": "priority",
            "x-gateway-inference-fairness-id": "team-pool"})
        assert r.status_code == 200 and r.headers["x-tierserve-served-tier"] == "priority"
        bad = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "Hello", "max_tokens": 3}, headers={
            "x-gateway-inference-objective": "critical"})
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "x-gateway-inference-objective"
        srv.wait_idle()
        time.sleep(0.5)  # the ledger writes on its own thread
        with sqlite3.connect(tmp_path / "l.db") as db:
            rows = db.execute("SELECT tenant, tier_served FROM requests").fetchall()
        assert rows == [("team-pool", "priority")]
        text = httpx.get(srv.url + "/metrics").text
        for name in ("vllm:num_requests_waiting{", "vllm:num_requests_running{",
                     "vllm:kv_cache_usage_perc{"):
            assert name in text, name
        info = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info{")]
        block = srv.engine.block_manager
        assert len(info) == 1 and f'block_size="{block.block_size}"' in info[0]
        assert f'num_gpu_blocks="{block.num_blocks}"' in info[0]
    finally:
        srv.stop()


def test_a_tenant_over_budget_gets_429_insufficient_quota_and_others_do_not():
    from tierserve.metering.recorder import Budget
    keys = {"sk-a": Tenant("a"), "sk-b": Tenant("b")}
    srv = LiveServer(ServerSettings(api_keys=keys, budgets={"a": Budget(1e-9, "day")}),
                     max_num_seqs=16)
    try:
        msg = [{"role": "user", "content": "hi"}]
        ok = srv.client("sk-a").chat.completions.create(model=MODEL, messages=msg,
                                                         max_tokens=3)
        assert ok.choices[0].message.content is not None  # under budget when it started
        r = httpx.post(srv.url + "/v1/chat/completions", json={"model": MODEL, "messages": msg},
                       headers={"Authorization": "Bearer sk-a"}, timeout=60)
        assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"
        assert "budget" in r.json()["error"]["message"]
        ok = srv.client("sk-b").chat.completions.create(model=MODEL, messages=msg, max_tokens=3)
        assert ok.choices[0].message.content is not None
    finally:
        srv.stop()
