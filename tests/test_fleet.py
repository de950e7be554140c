"""Fleet mode end to end: the gateway (the real server) in front of two real tierserve
replicas in their own processes, through real HTTP on 127.0.0.1. The vLLM replica tests
are in test_fleet_vllm.py."""

import concurrent.futures
import json
import sqlite3
import statistics
import time

import httpx
import pytest

from fleet_util import MODEL, Gateway, TierserveReplica
from pg import pg_database, pg_server  # noqa: F401 (fixtures)
from tierserve.router.flow import FlowConfig
from tierserve.server.settings import ServerSettings

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    logs = tmp_path_factory.mktemp("replicas")
    reps = [TierserveReplica(logs, "a"), TierserveReplica(logs, "b")]
    try:
        yield [r.wait_ready() for r in reps]
    finally:
        for r in reps:
            r.kill()


def ledger_rows(path) -> list[dict]:
    db = sqlite3.connect(path)
    db.row_factory = sqlite3.Row
    rows = [dict(r) for r in db.execute("SELECT * FROM requests ORDER BY id")]
    db.close()
    return rows


def test_tiers_routing_and_cost_through_the_gateway(replicas, tmp_path):
    ledger = tmp_path / "ledger.db"
    gw = Gateway([r.spec() for r in replicas], ServerSettings(ledger=str(ledger)))
    try:
        client = gw.client()
        r = client.chat.completions.create(
            # not "What is the capital of France?": float32 itself nearly ties its first
            # token there ("The" 0.152, "L" 0.140), and bf16's kernels may take either
            model=MODEL, messages=[{"role": "user", "content": "Name the capital of France."}],
            max_tokens=20, temperature=0)
        assert "Paris" in r.choices[0].message.content and r.service_tier == "default"
        cost = r.usage.model_extra["cost_details"]
        assert r.usage.model_extra["cost"] == cost["charge_usd"] > 0
        assert cost["machine_usd"] > 0 and cost["served_tier"] == "default"
        assert r.usage.prompt_tokens > 10 and r.usage.completion_tokens > 2
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True},
            service_tier="priority"))
        assert all(c.service_tier == "priority" for c in chunks)
        assert chunks[-1].usage.completion_tokens == 8
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # spread over both
            list(pool.map(lambda i: client.completions.create(
                model=MODEL, prompt=f"Request {i} says", max_tokens=6, temperature=0),
                range(12)))
        assert all(gw.backend.meters[name].machine_cost > 0 for name in ("a", "b"))
        bad = httpx.post(gw.url + "/v1/completions", json={
            "model": MODEL, "prompt": "x", "max_tokens": 100_000})
        assert bad.status_code == 400 and bad.json()["error"]["code"]  # the replica's 400
    finally:
        gw.stop()
    rows = ledger_rows(ledger)
    assert len(rows) == 15 and len({r["request_id"] for r in rows}) == 15
    assert {r["tier_served"] for r in rows} == {"default", "priority"}
    assert all(r["prefill_cost"] + r["decode_cost"] > 0 for r in rows)


def test_a_flex_request_with_no_room_is_refused(replicas):
    flow = FlowConfig(reserved_priority_seqs=15, flex_max_wait_s=0.3)  # one lower slot each
    gw = Gateway([r.spec() for r in replicas], flow=flow)
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            # Long enough to hold both lower slots well past the flex wait on a fast CPU
            # (60 tokens, the old length, were done in 0.5 s on an EPYC of family 26).
            busy = [pool.submit(lambda: httpx.post(gw.url + "/v1/completions", json={
                "model": MODEL, "prompt": "Long story:", "max_tokens": 400, "ignore_eos": True},
                timeout=120)) for _ in range(2)]
            time.sleep(0.5)
            flex = httpx.post(gw.url + "/v1/completions", json={
                "model": MODEL, "prompt": "hi", "max_tokens": 4, "service_tier": "flex"},
                timeout=60)
            prio = httpx.post(gw.url + "/v1/completions", json={
                "model": MODEL, "prompt": "hi", "max_tokens": 4, "service_tier": "priority"},
                timeout=60)
            assert all(b.result().status_code == 200 for b in busy)
        assert flex.status_code == 429
        assert flex.json()["error"]["code"] == "resource_unavailable"
        assert prio.status_code == 200 and prio.json()["service_tier"] == "priority"
    finally:
        gw.stop()


def test_a_replica_killed_mid_run_loses_nothing_and_bills_once(replicas, tmp_path):
    victim = TierserveReplica(tmp_path, "victim").wait_ready()
    ledger = tmp_path / "ledger.db"
    gw = Gateway([replicas[0].spec(), victim.spec()], ServerSettings(ledger=str(ledger)))
    outcomes = []

    def one(i):
        try:
            with httpx.stream("POST", gw.url + "/v1/completions", json={
                    "model": MODEL, "prompt": f"Story {i}:", "max_tokens": 40,
                    "ignore_eos": True, "stream": True}, timeout=120) as r:
                if r.status_code != 200:
                    return ("refused", r.status_code)
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            if events[-1] == "[DONE]":
                return ("done", len(events))
            return ("error", json.loads(events[-1])["error"]["code"])
        except httpx.HTTPError as exc:
            return ("broken", str(exc))

    try:
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            futures = [pool.submit(one, i) for i in range(10)]
            time.sleep(2.0)
            victim.kill()
            outcomes = [f.result() for f in futures]
        after = [one(100 + i) for i in range(4)]  # the dead replica left the rotation
    finally:
        gw.stop()
        victim.kill()
    kinds = [o[0] for o in outcomes]
    assert "broken" not in kinds and "refused" not in kinds, outcomes
    assert kinds.count("done") + kinds.count("error") == 10  # each ends, done or with an event
    assert kinds.count("done") >= 3  # at least those on replica a (the split varies)
    assert all(o[0] == "done" for o in after), after
    rows = ledger_rows(ledger)
    assert len(rows) == 14 and len({r["request_id"] for r in rows}) == 14  # once each
    errors = [r for r in rows if r["finish_reason"] == "error"]
    assert len(errors) == kinds.count("error")


def test_batch_jobs_run_through_the_fleet(replicas, tmp_path):
    gw = Gateway([r.spec() for r in replicas],
                 ServerSettings(data_dir=str(tmp_path / "data")))
    try:
        client = gw.client()
        lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                             "body": {"model": MODEL, "prompt": f"Item {i}:",
                                      "max_tokens": 5}}) for i in range(6)]
        f = client.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                      completion_window="24h")
        deadline = time.time() + 120
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            assert time.time() < deadline, batch
            time.sleep(0.5)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed" and batch.request_counts.completed == 6
        out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        assert sorted(o["custom_id"] for o in out) == [f"c{i}" for i in range(6)]
        assert all(o["response"]["body"]["service_tier"] == "batch" for o in out)
    finally:
        gw.stop()


def test_metering_estimate_against_the_replicas_exact_meter(replicas):
    """The gateway's estimate per request against what the tierserve replica's own meter
    reports, and each replica's requests + idle == its machine cost."""
    gw = Gateway([r.spec() for r in replicas])
    try:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda i: httpx.post(gw.url + "/v1/completions", json={
                "model": MODEL, "prompt": "word " * (20 + 15 * (i % 5)), "max_tokens": 24,
                "ignore_eos": True}, timeout=120).json(), range(18)))
        checks = [(e.machine_cost, x.machine_cost) for e, x in gw.backend.cost_checks]
    finally:
        gw.stop()
    assert all(r["usage"]["cost_details"]["machine_usd"] > 0 for r in results)
    assert len(checks) == 18 and all(exact for _, exact in checks)
    errors = [abs(est - exact) / exact for est, exact in checks]
    print("estimate/exact", sorted(round(e / x, 3) for e, x in checks))
    assert statistics.median(errors) < 0.5  # the benchmark measures it: docs/benchmarks.md
    for meter in gw.backend.meters.values():
        assert meter.attributed + meter.idle_cost + meter.reserved_idle_cost == pytest.approx(
            meter.machine_cost, rel=1e-9)


def test_two_gateways_share_a_postgres_ledger_and_budget(replicas, pg_database,  # noqa: F811
                                                        tmp_path):
    """Two gateways (as on two machines) with one PostgreSQL ledger: a tenant's budget
    holds across them; each gateway's spend is seen by the other."""
    from tierserve.metering.recorder import Budget
    from tierserve.server.settings import Tenant

    def settings():
        return ServerSettings(api_keys={"sk-a": Tenant("a")}, database=pg_database,
                              budgets={"a": Budget(4e-5, "day")})

    gateways = [Gateway([r.spec() for r in replicas], settings()) for _ in range(2)]
    charges, refused = [], [0, 0]
    try:
        for i in range(16):
            g = i % 2
            r = httpx.post(gateways[g].url + "/v1/completions", headers={
                "Authorization": "Bearer sk-a"}, json={
                "model": MODEL, "prompt": "Count: one two three", "max_tokens": 12,
                "ignore_eos": True}, timeout=60)
            if r.status_code == 429:
                assert r.json()["error"]["code"] == "insufficient_quota"
                refused[g] += 1
            else:
                assert r.status_code == 200
                charges.append(r.json()["usage"]["cost"])
            time.sleep(0.8)  # the ledger commits; the other gateway reads it
    finally:
        for g in gateways:
            g.stop()
    assert refused[0] and refused[1], refused  # both gateways stopped the tenant
    assert sum(charges) <= 4e-5 + 2 * max(charges)  # one request past, at most, each
    import psycopg
    with psycopg.connect(pg_database) as db:
        rows = db.execute("SELECT count(*), sum(charge) FROM requests WHERE tenant = 'a'"
                          ).fetchone()
    assert rows[0] == len(charges) and rows[1] == pytest.approx(sum(charges))


def test_replica_connections_are_kept_alive_and_a_closed_one_is_replaced(replicas):
    """remote.session: a stream read to its end gives its connection back; one the
    replica would close while idle (uvicorn: after 5 s) is not used again."""
    import asyncio

    from tierserve.router import remote
    from tierserve.router.remote import ReplicaSpec
    from tierserve.tiers import Tier

    spec = ReplicaSpec(replicas[0].url, [MODEL], "tierserve", name="a")
    body = remote.upstream_body(spec, "/v1/completions", {"prompt": "Hello", "max_tokens": 2},
                                MODEL, Tier.DEFAULT, 0)

    async def run():
        session = remote.session(5.0, 60.0)
        try:
            opened = []
            for wait in (0.0, 0.0, 5.5):
                await asyncio.sleep(wait)
                chunks = [c async for c in remote.stream(session, spec, "/v1/completions",
                                                         body)]
                assert any(c.get("usage") for c in chunks)
                opened.append(session.connector._conns and sum(  # aiohttp's idle pool
                    len(v) for v in session.connector._conns.values()))
            return opened
        finally:
            await session.close()

    first, second, third = asyncio.run(run())
    assert first == second == 1  # one connection, kept alive and reused
    assert third == 1  # after the idle gap: dropped before the replica closed it, a new one


HI_PET = [{"role": "user", "content": "Describe a pet as JSON."}]


def test_structured_output_tools_and_sampling_fields_reach_the_replicas(replicas):
    """The gateway sends the schema on (as vLLM's structured_outputs), renders tools and
    parses the calls itself, and refuses what it cannot relay rather than drop it."""
    from fleet_util import check_schema_and_tool_call
    gw = Gateway([r.spec() for r in replicas])
    try:
        c = gw.client()
        check_schema_and_tool_call(c)
        banned = c.completions.create(model=MODEL, prompt="The sea is", max_tokens=3,
                                      temperature=0, frequency_penalty=1.5)
        assert banned.choices[0].text
        lp = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": HI_PET, "max_tokens": 2, "logprobs": True})
        assert lp.status_code == 400 and lp.json()["error"]["param"] == "logprobs"
    finally:
        gw.stop()


def test_a_gateway_learns_what_a_replica_given_by_its_v1_base_url_serves(replicas):
    """`--backend http://host:port/v1` (an OpenAI client's base URL): the gateway strips
    the /v1, asks the replica for its models and kind, names itself after its model, and
    sends it the tier as tierserve reads it (its exact cost then reaches the bill)."""
    from tierserve.router.remote import ReplicaSpec, discover
    from tierserve.server.settings import ServerSettings

    [spec] = ServerSettings.parse_backends([replicas[0].url + "/v1/"])
    assert spec.url == replicas[0].url and spec.kind is None and spec.models == []
    line = discover(spec)
    assert spec.kind == "tierserve" and spec.models[0] == MODEL, line
    assert "answered: tierserve (detected)" in line and "(learned)" in line
    down = ReplicaSpec.parse("http://127.0.0.1:9/v1", 0)
    line = discover(down, timeout_s=1)
    assert down.kind == "vllm" and "did not answer" in line
    gw = Gateway([spec])
    try:
        r = gw.client().completions.create(model=MODEL, prompt="Hello", max_tokens=3,
                                           extra_body={"service_tier": "priority"})
        assert r.usage.model_extra["cost_details"]["machine_usd"] > 0
        assert gw.backend.cost_checks  # billed at the replica's exact figure
    finally:
        gw.stop()


def _recorder(gateway):
    """Spy on a flow Gateway: each arrival as it saw it (instant, request id, tier,
    prompt tokens, max tokens) and the replica index each request was sent to first."""
    arrivals, sent = [], {}
    submit, send = gateway.submit, gateway.sent
    names = [r.name for r in gateway.replicas]

    def on_submit(p):
        arrivals.append((p.arrival, p.request_id, p.tier.label, p.prompt_tokens, p.max_tokens))
        submit(p)

    def on_sent(p, replica, now):
        sent.setdefault(p.request_id, names.index(replica.name))
        send(p, replica, now)
    gateway.submit, gateway.sent = on_submit, on_sent
    return arrivals, sent


def test_the_fleet_twin_routes_a_recorded_arrival_sequence_as_the_gateway_did(replicas):
    """The real gateway over the two replicas takes a sequence of arrivals: prompts of
    token ids in four prefix groups, spaced out and in bursts, in three tiers. What it saw
    is recorded (each arrival's instant, tier, prompt; where it sent each request), and
    the simulator's gateway (`sim --router gateway`: router/flow.py over twins with the
    replicas' step-time profile) replays the recording: every request goes to the same
    replica. The sequence is laid out so that each decision is far from a timing
    boundary (a burst arrives within a prefill; a request arriving beside a long one finds
    it decoding), so the twin's step times need not be exact for the check to hold."""
    from tierserve.config import SchedulerConfig
    from tierserve.model.shapes import preset
    from tierserve.server.serve import DEFAULT_CPU_PROFILE
    from tierserve.sim.fleet import FleetConfig, machine_for, make_simulator, \
        step_time_limit
    from tierserve.sim.workload import SimRequest

    groups = [[1000 + 500 * g + j for j in range(192)] for g in range(4)]  # 3 prefix blocks
    serial = iter(range(10_000))

    def prompt(g, n):  # a group's prefix, then tokens no other prompt has; unique length
        k = next(serial)
        return groups[g] + [20_000 + 97 * k + j for j in range(n + k)]
    plan = []  # (seconds after the previous send, group, tier, suffix tokens, max tokens)
    for g, tier in ((0, "default"), (1, "default"), (2, "priority"), (3, "flex")):
        plan.append((1.0, g, tier, 40, 8))       # spaced: each alone on the fleet
    for g, tier in ((2, "default"), (0, "priority"), (3, "default"), (1, "flex")):
        plan.append((1.0, g, tier, 40, 8))       # again: each to where its prefix is
    plan.append((1.0, 0, "default", 200, 8))     # a burst of one group within a prefill:
    plan += [(0.005, 0, "default", 200, 8)] * 3  # the queued prefill outweighs the prefix
    # a long one once the burst has drained, then beside it as it decodes: its prefix
    # outweighs one decode (gaps for a one-thread float32 replica on an AVX2 CPU, where
    # 3 s and 0.8 s caught it still prefilling, and for a fast one, still decoding)
    plan.append((6.0, 1, "default", 40, 200))
    plan.append((1.5, 1, "priority", 40, 8))
    plan.append((0.05, 2, "default", 40, 8))
    ledger = {}
    flow = FlowConfig(priority_ttft_s=1.0, priority_tpot_s=0.15)
    gw = Gateway([r.spec() for r in replicas], flow=flow)
    arrivals, sent = _recorder(gw.backend.gateway)

    def send(item):
        tokens, tier, max_tokens = item
        r = httpx.post(gw.url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "service_tier": tier})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["completion_tokens"]
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = []
            for gap, g, tier, n, max_tokens in plan:
                time.sleep(gap)
                tokens = prompt(g, n)
                ledger[len(tokens)] = tokens
                futures.append(pool.submit(send, (tokens, tier, max_tokens)))
            assert [f.result() for f in futures] == [p[4] for p in plan]
    finally:
        gw.stop()
    assert len(arrivals) == len(plan) and len(sent) == len(plan)
    t0 = arrivals[0][0]
    trace = [SimRequest(t - t0, tier, n, m, prompt_ids=tuple(ledger[n]))
             for t, _, tier, n, m in arrivals]
    real = [sent[rid] for _, rid, *_ in arrivals]
    machine = machine_for(preset("smollm2-135m"), step_time_profile=DEFAULT_CPU_PROFILE,
                          num_kv_blocks=700)
    sim = make_simulator(machine, SchedulerConfig(max_num_seqs=16), FleetConfig(
        replicas=2, router="gateway", reserved_priority_seqs=flow.reserved_priority_seqs),
        step_time_limit(machine.model, {}),  # each replica's own cap, as `serve` sets it
        slo={"priority": (flow.priority_ttft_s, flow.priority_tpot_s)})
    twin_arrivals, twin_sent = _recorder(sim.gateway)
    result = sim.run(trace)
    assert len(result.requests) == len(plan)
    twin = [twin_sent[rid] for _, rid, *_ in twin_arrivals]
    assert twin == real, (twin, real)
    # and the sequence tested what it says: prefixes followed, a burst spread
    assert len(set(real[:4])) == 2 and len(set(real[8:12])) == 2
    assert real[4:8] == [real[2], real[0], real[3], real[1]]
