"""Fleet mode's gateway logic without replicas: per-tier queues, the release rule, routing,
the adaptive limit, the replica cost estimate (property-tested), and the health check
against a bare HTTP endpoint."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierserve.core.step_time import StepTimeModel
from tierserve.tiers import Tier
from tierserve.metering.estimate import ReplicaMeter
from tierserve.router.flow import PREFIX_BLOCK, FlowConfig, Gateway, Pending, ReplicaState, \
    prefix_keys

MODEL = StepTimeModel(fixed_s=0.010, per_seq_s=0.0002, per_token_s=0.00005,
                      per_kv_token_s=1e-8, per_pair_s=1e-10)


def gateway(n=2, seqs=8, **flow):
    flow.setdefault("reserved_priority_seqs", 2)
    return Gateway([ReplicaState(f"r{i}", seqs) for i in range(n)], FlowConfig(**flow))


def req(i, tier=Tier.DEFAULT, prompt=100, t=0.0, keys=()):
    return Pending(f"q{i}", tier, prompt, 16, t, list(keys))


def test_priority_goes_at_once_lower_tiers_wait_for_room():
    g = gateway(n=1, seqs=4, reserved_priority_seqs=1)
    reqs = [req(i) for i in range(5)]
    for r in reqs:
        g.submit(r)
    out, _ = g.release(0.0)
    assert [p.request_id for p, _ in out] == ["q0", "q1", "q2"]  # 4 slots, 1 kept
    g.submit(req(9, Tier.PRIORITY))
    out, _ = g.release(0.1)
    assert [p.request_id for p, _ in out] == ["q9"]  # over the limit: priority passes
    g.finished(reqs[0], 0.2)
    out, _ = g.release(0.2)
    assert [p.request_id for p, _ in out] == ["q3"]


def test_tier_order_and_flex_refusal():
    g = gateway(n=1, seqs=3, reserved_priority_seqs=1, flex_max_wait_s=5.0)
    g.submit(req(1, Tier.BATCH))
    g.submit(req(2, Tier.FLEX))
    g.submit(req(3, Tier.DEFAULT))
    g.submit(req(4, Tier.FLEX))
    out, refused = g.release(0.0)
    assert [p.request_id for p, _ in out] == ["q3", "q2"]  # default, then flex
    out, refused = g.release(6.0)
    assert not out and [p.request_id for p in refused] == ["q4"]  # waited past 5 s
    assert [p.request_id for p in g.queues[Tier.BATCH]] == ["q1"]


def test_prefix_affinity_prefers_the_replica_that_holds_the_prefix():
    g = gateway(n=3, seqs=64)
    shared = list(range(10 * PREFIX_BLOCK))
    first = req(0, prompt=len(shared) + 5, keys=prefix_keys(shared + [1, 2, 3, 4, 5]))
    g.submit(first)
    (_, home), = g.release(0.0)[0]
    g.first_token(first, 0.1)  # decoding there now: it weighs a little
    for i in range(1, 6):  # same prefix, other tails: all to the same replica
        tail = [1000 + i] * 5
        g.submit(q := req(i, prompt=len(shared) + 5, keys=prefix_keys(shared + tail)))
        (_, r), = g.release(0.0)[0]
        assert r is home
        g.first_token(q, 0.2)
        g.finished(q, 0.3)
    g.submit(req(9, prompt=64, keys=prefix_keys(list(range(5000, 5064)))))
    (_, r), = g.release(0.0)[0]
    assert r is not home  # nothing shared: the least loaded


def test_round_robin_alternates_replicas_whatever_the_load_or_prefix():
    g = gateway(n=2, seqs=64, routing="round-robin")
    shared = list(range(4 * PREFIX_BLOCK))
    picked = []
    for i in range(6):  # same prefix each time, none finishes: affinity or load would
        g.submit(req(i, prompt=len(shared), keys=prefix_keys(shared)))  # not alternate
        (_, r), = g.release(0.0)[0]
        picked.append(r.name)
    assert picked == ["r0", "r1"] * 3
    g.replicas[1].healthy = False  # a replica that may not take it is skipped
    g.submit(req(7))
    g.submit(req(8))
    assert [r.name for _, r in g.release(0.0)[0]] == ["r0", "r0"]


def test_unknown_routing_is_a_config_error():
    from tierserve.errors import ConfigError

    with pytest.raises(ConfigError):
        FlowConfig(routing="random")


def test_limit_backs_off_on_priority_misses_and_recovers():
    g = gateway(n=1, seqs=20, reserved_priority_seqs=4, priority_ttft_s=0.1, cooldown_s=0.0,
                idle_s=30.0)
    r = g.replicas[0]
    assert r.limit == 16
    p = req(1, Tier.PRIORITY)
    g.submit(p)
    g.release(0.0)
    g.finished(p, 1.0, ttft_s=0.5, tpot_s=0.01)  # a miss: cut
    assert r.limit == pytest.approx(16 * 0.7)
    for i in range(40):  # lower-tier work queued; the SLO met again: back up, one by one
        g.submit(req(100 + i))
    g.release(1.0)
    limits = []
    for i in range(10):
        p = req(200 + i, Tier.PRIORITY)
        g.submit(p)
        g.release(2.0 + i)
        g.finished(p, 2.0 + i, ttft_s=0.05, tpot_s=0.01)
        limits.append(r.limit)
    assert limits == sorted(limits) and limits[-1] == 16
    g.release(100.0)  # idle: the cap
    assert r.limit == 16


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(list(Tier)), st.integers(1, 400),
                          st.floats(0.0, 0.2)), min_size=1, max_size=60),
       st.integers(1, 3), st.integers(2, 12), st.integers(0, 2**16))
def test_release_invariants(arrivals, n, seqs, seed):
    """Lower tiers never exceed a replica's limit; priority is never held; FIFO within a
    tier; every request is sent once or refused once."""
    rng = random.Random(seed)
    g = gateway(n=n, seqs=seqs, reserved_priority_seqs=1, flex_max_wait_s=0.5)
    t, sent, refused, running = 0.0, [], [], []
    for i, (tier, prompt, gap) in enumerate(arrivals):
        t += gap
        g.submit(req(i, tier, prompt, t))
        out, ref = g.release(t)
        sent += [p for p, _ in out]
        running += [p for p, _ in out]
        refused += ref
        assert not g.queues[Tier.PRIORITY]
        for r in g.replicas:
            assert r.lower_in_flight <= max(r.limit, 0) or r.lower_in_flight == 0
        if running and rng.random() < 0.5:
            done = running.pop(rng.randrange(len(running)))
            g.finished(done, t)
    for tier in Tier:
        order = [int(p.request_id[1:]) for p in sent if p.tier == tier]
        assert order == sorted(order)
    ids = [p.request_id for p in sent] + [p.request_id for p in refused]
    assert len(ids) == len(set(ids))
    assert all(p.tier == Tier.FLEX for p in refused)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["start", "tokens", "finish"]), st.integers(0, 5),
                          st.floats(0.0, 0.5), st.integers(1, 300)),
                min_size=1, max_size=80))
def test_replica_meter_conserves_cost(events):
    """Requests + idle == machine cost of the window, whatever the event order."""
    meter = ReplicaMeter(3.6, MODEL)
    t, live, total = 0.0, set(), 0.0
    for kind, k, dt, n in events:
        t += dt
        rid = f"r{k}"
        if kind == "start" and rid not in live:
            meter.start(rid, t, n, cached_tokens=n // 3)
            live.add(rid)
        elif kind == "tokens" and rid in live:
            meter.tokens(rid, t, 1 + n % 3)
        elif kind == "finish" and rid in live:
            c = meter.finish(rid, t)
            assert c.prefill_cost >= 0 and c.decode_cost >= 0
            total += c.machine_cost
            live.discard(rid)
    for rid in list(live):
        total += meter.finish(rid, t).machine_cost
    meter.close_window(t + 1.0)
    assert total + meter.idle_cost + meter.reserved_idle_cost == pytest.approx(
        meter.machine_cost, rel=1e-9, abs=1e-15)
    assert meter.machine_cost == pytest.approx((t + 1.0 - _first(events)) * 3.6 / 3600,
                                               rel=1e-9, abs=1e-15) or not meter.machine_cost


def _first(events):
    t = 0.0
    for kind, _, dt, _ in events:
        t += dt
        if kind == "start":
            return t
    return t


def test_replica_meter_splits_like_the_engine_when_busy():
    """Two requests decoding side by side at the same pace pay the same; a long prompt's
    prefill costs more than a short one's."""
    m = ReplicaMeter(3600.0, MODEL)
    m.start("a", 0.0, 1000)
    m.start("b", 0.0, 10)
    for i in range(1, 30):
        m.tokens("a", 0.05 * i)
        m.tokens("b", 0.05 * i)
    a, b = m.finish("a", 1.5), m.finish("b", 1.5)
    assert a.prefill_cost > 3 * b.prefill_cost
    assert a.decode_cost == pytest.approx(b.decode_cost, rel=0.25)


def test_the_simulated_fleet_runs_the_gateways_own_code():
    """`tierserve sim --router gateway` drives router/flow.py's Gateway: under overload the
    fast lane overtakes the queued lower tiers, and every request ends."""
    from tierserve.config import SchedulerConfig
    from tierserve.core.stats import percentile
    from tierserve.model.shapes import preset
    from tierserve.router.flow import Gateway as FlowGateway
    from tierserve.sim.fleet import FleetConfig, machine_for, make_simulator
    from tierserve.sim.workload import make_workload

    machine = machine_for(preset("llama-3-8b"), "h100-sxm", num_kv_blocks=4000)
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048, policy="priority")
    sim = make_simulator(machine, config, FleetConfig(replicas=2, router="gateway",
                                                      reserved_priority_seqs=4),
                         None, slo={"priority": (0.5, 0.05)})
    assert isinstance(sim.gateway, FlowGateway)
    result = sim.run(make_workload("poisson:rate=60,n=600,priority=0.2,flex=0.0,"
                                   "prompt=256-1024,output=64-256,seed=3"))
    assert len(result.requests) == 600
    ttft = {t: percentile([r.ttft_s for r in result.requests if r.tier.label == t], 0.9)
            for t in ("priority", "default")}
    assert ttft["priority"] < 0.5 * ttft["default"], ttft
    assert all(r.finish_reason == "length" for r in result.requests)


def test_a_replica_of_another_model_is_a_config_error():
    """A pool serves one model: a replica listing several models, none of them the
    gateway's, would get requests for a model it may not be serving."""
    from tierserve.errors import ConfigError
    from tierserve.router.fleet import FleetBackend
    from tierserve.router.remote import ReplicaSpec, upstream_body
    two = ReplicaSpec("http://127.0.0.1:1", ["llama", "qwen"], "vllm", name="a")
    with pytest.raises(ConfigError, match="one pool serves one model"):
        FleetBackend([two], "smol", MODEL)
    FleetBackend([two], "qwen", MODEL)  # it lists the gateway's model: that one is sent
    assert upstream_body(two, "/v1/completions", {}, "qwen", Tier.DEFAULT, 0)["model"] == "qwen"
    alias = ReplicaSpec("http://127.0.0.1:1", ["HuggingFaceTB/SmolLM2"], "vllm", name="b")
    assert upstream_body(alias, "/v1/completions", {}, "smol", Tier.DEFAULT, 0)["model"] == \
        "HuggingFaceTB/SmolLM2"


def test_the_gateway_shares_a_tier_fairly_between_tenants():
    """A's burst of 30 then B's 3: B's go out among A's first ones, not after all 30; one
    tenant's own requests keep their arrival order."""
    g = gateway(n=1, seqs=4, reserved_priority_seqs=0)
    for i in range(30):
        g.submit(Pending(f"a{i}", Tier.DEFAULT, 100, 16, 0.0, tenant="a"))
    for i in range(3):
        g.submit(Pending(f"b{i}", Tier.DEFAULT, 100, 16, 0.0, tenant="b"))
    order = []
    while g.num_queued:
        out, _ = g.release(float(len(order)))
        for p, _ in out:
            order.append(p.request_id)
            g.finished(p, float(len(order)))
    assert max(order.index(f"b{i}") for i in range(3)) < 8, order
    a_order = [x for x in order if x.startswith("a")]
    assert a_order == [f"a{i}" for i in range(30)]


def test_overdue_flex_requests_are_refused_wherever_they_sit_in_fair_order():
    g = gateway(n=1, seqs=1, reserved_priority_seqs=0, flex_max_wait_s=5.0)
    g.replicas[0].healthy = False  # down: nothing is released
    g.submit(Pending("old", Tier.FLEX, 100, 16, 0.0, tenant="a"))
    g.submit(Pending("a2", Tier.FLEX, 100, 16, 4.0, tenant="a"))
    g.submit(Pending("b", Tier.FLEX, 100, 16, 4.0, tenant="b"))
    _, refused = g.release(6.0)
    assert [p.request_id for p in refused] == ["old"]
    assert [p.request_id for p in g.queues[Tier.FLEX]] == ["b", "a2"]


def test_a_replica_answering_its_health_check_late_stays_until_three_in_a_row():
    """Under a full batch a replica may answer /health after the check's timeout and still
    be serving: two late answers in a row keep it in the rotation, a third takes it out;
    a prompt answer brings it back, and a refused connection takes it out at once."""
    import asyncio
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tierserve.router.fleet import SLOW_CHECKS, FleetBackend
    from tierserve.router.remote import ReplicaSpec
    state = {"late": 0, "forever": False, "answers": 0}

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            if state["forever"] or state["late"]:
                state["late"] = max(0, state["late"] - 1)
                time.sleep(0.5)  # past the check's 0.2 s
            state["answers"] += 1
            try:
                self.send_response(200)
                self.end_headers()
            except OSError:
                pass  # the gateway gave up on this one

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"

    async def run():
        backend = FleetBackend([ReplicaSpec(url, ["smol"], "openai", name="a")], "smol", MODEL,
                               flow=FlowConfig(priority_ttft_s=1.0), health_interval_s=0.2)
        [replica] = backend.gateway.replicas

        async def until(cond, what, limit_s=10.0):
            end = time.monotonic() + limit_s
            while not cond():
                assert time.monotonic() < end, what
                await asyncio.sleep(0.02)

        try:
            await backend.probe()
            assert replica.healthy
            start = state["answers"]
            state["late"] = SLOW_CHECKS - 1
            seen = []
            while state["answers"] < start + SLOW_CHECKS + 1:  # the late ones, then one prompt
                seen.append(replica.healthy)
                await asyncio.sleep(0.02)
            assert all(seen), "two late answers took the replica out"
            state["forever"] = True
            await until(lambda: not replica.healthy, "three late answers did not take it out")
            state["forever"] = False
            await until(lambda: replica.healthy, "a prompt answer did not bring it back")
            server.shutdown()
            server.server_close()
            t = time.monotonic()
            await until(lambda: not replica.healthy, "a refused connection left it in")
            assert time.monotonic() - t < 1.0  # the next check, not three
        finally:
            await backend.stop()

    try:
        asyncio.run(run())
    finally:
        server.server_close()
