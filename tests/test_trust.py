"""Promises a billing server makes to tenants that share it: cached prompts stay private,
budgets hold under concurrency, rate limits answer 429 with OpenAI's headers, tenants in
one tier share it fairly, and the ledger charges each request id once."""

import concurrent.futures

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import make_scheduler, run_to_completion
from test_server import MODEL, LiveServer
from tierserve.core.request import Owner, Request
from tierserve.core.stats import RequestStats
from tierserve.errors import OverloadedError
from tierserve.metering.prices import PriceList
from tierserve.metering.recorder import Budget, Recorder
from tierserve.server.limits import RateLimit, RateLimiter
from tierserve.server.settings import ServerSettings, Tenant
from tierserve.tiers import Tier

SYSTEM = ("You are a support assistant for a company that sells bicycles, spare parts and "
          "repairs. Answer briefly, politely, and only about the company's products. ") * 3


@pytest.fixture(scope="module")
def server():
    keys = {"sk-a": Tenant("a"), "sk-b": Tenant("b"),
            "sk-c": Tenant("c", cache_group="shop"), "sk-d": Tenant("d", cache_group="shop"),
            "sk-poor": Tenant("poor"), "sk-limited": Tenant("limited")}
    srv = LiveServer(ServerSettings(
        api_keys=keys, budgets={"poor": Budget(1e-9, "day")},
        rate_limits={"limited": RateLimit(requests_per_minute=2, tokens_per_minute=10_000)}),
        max_num_seqs=16)
    yield srv
    srv.stop()


def chat(srv, key, content="hi", max_tokens=2, **extra):
    return httpx.post(srv.url + "/v1/chat/completions", timeout=120,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
                            "messages": [{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": content}], **extra})


def cached(r) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


# ------------------------------------------------------------ cache isolation
def test_a_tenant_cannot_hit_another_tenants_cached_prompt(server):
    assert cached(chat(server, "sk-a")) == 0
    assert cached(chat(server, "sk-a")) > 50  # its own prompt: cached
    assert cached(chat(server, "sk-b")) == 0  # the same prompt from another tenant: not
    assert cached(chat(server, "sk-a", cache_salt="v2")) == 0  # another salt: not either
    assert cached(chat(server, "sk-a", cache_salt="v2")) > 50


def test_tenants_of_one_cache_group_share_cached_prefixes(server):
    chat(server, "sk-c", "first")
    assert cached(chat(server, "sk-d", "second")) > 50


# ------------------------------------------------------------------- budgets
def test_a_tiny_budget_admits_one_request_of_sixteen_sent_at_once(server):
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda i: chat(server, "sk-poor", f"q{i}", 8), range(16)))
    codes = sorted(r.status_code for r in answers)
    assert codes == [200] + [429] * 15, codes
    refused = [r.json()["error"] for r in answers if r.status_code == 429]
    assert {e["code"] for e in refused} == {"insufficient_quota"}
    server.wait_idle()
    recorder = server.app.state.tierserve.recorder
    assert recorder.reserved("poor") == 0  # settled: nothing stays held


@settings(max_examples=200, deadline=None)
@given(budget=st.floats(0, 1e-3),
       ops=st.lists(st.tuples(st.integers(1, 4000), st.integers(1, 2000),
                              st.floats(0, 1), st.booleans()), max_size=60))
def test_spend_never_passes_the_budget_by_more_than_one_worst_case(budget, ops):
    """Requests (prompt, max_tokens, fraction of max_tokens produced, finishes now or
    later) admitted in any interleaving: spend ends at most one worst case over."""
    prices = PriceList()
    rec = Recorder("m", prices, None, {"t": Budget(budget, "total")})
    held, worst_max = [], 0.0
    for i, (prompt, max_tokens, fraction, settle_now) in enumerate(ops):
        worst = prices.charge(Tier.DEFAULT, prompt, 0, max_tokens)
        try:
            rec.reserve("t", [(f"r{i}", worst)])
        except OverloadedError as exc:
            assert exc.code == "insufficient_quota"
            continue
        worst_max = max(worst_max, worst)
        rec.register(f"r{i}", "t", Tier.DEFAULT, None)
        held.append(RequestStats(f"r{i}", 0.0, first_scheduled_time=0.0,
                                 num_prompt_tokens=prompt,
                                 num_output_tokens=int(fraction * max_tokens)))
        if settle_now:
            rec.finished(held.pop(), None)
    for stats in held:
        rec.finished(stats, None)
    assert rec.reserved("t") == 0
    assert rec.spent("t") <= budget + worst_max + 1e-12


# --------------------------------------------------------------- rate limits
def test_rate_limits_answer_429_with_openai_headers(server):
    ok = chat(server, "sk-limited")
    assert ok.status_code == 200
    assert ok.headers["x-ratelimit-limit-requests"] == "2"
    assert ok.headers["x-ratelimit-remaining-requests"] == "1"
    assert int(ok.headers["x-ratelimit-remaining-tokens"]) < 10_000
    assert ok.headers["x-ratelimit-reset-requests"].endswith("s")
    assert chat(server, "sk-limited").status_code == 200
    r = chat(server, "sk-limited")
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(r.headers["retry-after"]) >= 1
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    assert chat(server, "sk-a").status_code == 200  # other tenants are not limited


@settings(max_examples=100, deadline=None)
@given(rpm=st.integers(1, 100), sends=st.lists(st.floats(0, 5), max_size=80))
def test_a_bucket_never_lets_more_through_than_its_allowance(rpm, sends):
    """Over any window of t seconds at most rpm + rpm * t / 60 requests get through; a
    request held back is a 429 rate_limit_exceeded with a retry time, and one sent when
    the bucket holds a whole request's allowance gets through."""
    now = [0.0]
    limiter = RateLimiter({"t": RateLimit(requests_per_minute=rpm)}, clock=lambda: now[0])
    passed, level = [], float(rpm)  # the bucket starts full
    for gap in sends:
        now[0] += gap
        level = min(rpm, level + rpm * gap / 60)
        try:
            limiter.take("t", 1, 0)
        except OverloadedError as exc:
            assert exc.code == "rate_limit_exceeded" and exc.retry_after_s >= 1
            assert level < 1 + 1e-9, "refused with a whole request in the bucket"
            continue
        assert level >= 1 - 1e-9, "let through with less than a request in the bucket"
        level -= 1
        passed.append(now[0])
    for i, start in enumerate(passed):
        for j in range(i, len(passed)):
            assert j - i + 1 <= rpm + rpm * (passed[j] - start) / 60 + 1e-9


def test_a_request_bigger_than_the_token_allowance_says_so():
    limiter = RateLimiter({"t": RateLimit(tokens_per_minute=100)})
    with pytest.raises(Exception, match="at most 100 tokens per minute"):
        limiter.take("t", 1, 500)


# --------------------------------------------------------------- fair shares
def tenant_requests(tenant, n, start, weight=1.0, prompt_len=8, max_tokens=4, tier=Tier.DEFAULT):
    return [Request(f"{tenant}{start + i}", [5 + i] * prompt_len, max_tokens, tier=tier,
                    owner=Owner(tenant, weight)) for i in range(n)]


def served_order(sched, requests) -> list[str]:
    for r in requests:
        sched.add_request(r)
    order = {}
    for out in run_to_completion(sched):
        order.update((s.request_id, None) for s in out.seqs if s.request_id not in order)
    return list(order)


def test_a_burst_does_not_starve_another_tenants_trickle():
    """A sends 40 at once, B 4 just after: B's are served among A's first, not last."""
    sched = make_scheduler(policy="tiered", max_num_seqs=2, max_num_batched_tokens=16)
    order = served_order(sched, tenant_requests("a", 40, 0) + tenant_requests("b", 4, 0))
    b_positions = [order.index(f"b{i}") for i in range(4)]
    assert max(b_positions) < 10, order


def jain(xs) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


@settings(max_examples=30, deadline=None)
@given(burst=st.integers(20, 60), weight_b=st.sampled_from([1.0, 2.0]))
def test_backlogged_tenants_get_tokens_in_proportion_to_their_weights(burst, weight_b):
    """While both have work waiting, tokens served split by weight (Jain >= 0.9)."""
    sched = make_scheduler(policy="tiered", max_num_seqs=2, max_num_batched_tokens=16)
    requests = tenant_requests("a", burst, 0) + tenant_requests("b", burst // 10 * 2, 0,
                                                                weight=weight_b)
    order = served_order(sched, requests)
    last_b = max(i for i, rid in enumerate(order) if rid.startswith("b"))
    window = order[:last_b + 1]
    share = [sum(r.startswith(t) for r in window) / w for t, w in (("a", 1.0), ("b", weight_b))]
    assert jain(share) >= 0.9, (share, order)


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 20)), min_size=1,
                        max_size=30))
def test_one_tenant_alone_is_served_in_arrival_order(lengths):
    sched = make_scheduler(policy="tiered", max_num_seqs=3, max_num_batched_tokens=32,
                           num_blocks=256)
    requests = [Request(f"r{i}", [7] * p, m, arrival_time=float(i), owner=Owner("solo"))
                for i, (p, m) in enumerate(lengths)]
    assert served_order(sched, requests) == [r.request_id for r in requests]


def test_tiers_stay_strictly_ordered_above_fair_shares():
    sched = make_scheduler(policy="tiered", max_num_seqs=1, max_num_batched_tokens=16)
    order = served_order(sched, tenant_requests("a", 5, 0, tier=Tier.FLEX)
                         + tenant_requests("b", 3, 0, tier=Tier.DEFAULT))
    assert order[:3] == ["b0", "b1", "b2"]


# -------------------------------------------------------------------- ledger
def test_a_request_id_written_twice_is_one_row(tmp_path):
    from tierserve.metering.ledger import Ledger, RequestRow, connect
    ledger = Ledger(tmp_path / "l.db")
    for charge in (1.0, 2.0):
        ledger.record(RequestRow(1.0, "batch_req_x_0", "t", "m", "batch", "batch", 3, 0, 2,
                                 0, 0, 0, 0.1, 0.1, charge, "stop"))
    done = []
    ledger.barrier(lambda: done.append(True))
    ledger.close()
    assert done == [True]
    rows = connect(tmp_path / "l.db").execute("SELECT charge FROM requests").fetchall()
    assert [r[0] for r in rows] == [2.0]  # the later run (the answer kept) replaces it


# ----------------------------------------------------------------- admin API
ADMIN = "admin-key-0123456789"


def test_tenants_and_keys_change_without_a_restart_and_persist(tmp_path):
    ledger = str(tmp_path / "ledger.db")
    srv = LiveServer(ServerSettings(admin_key=ADMIN, ledger=ledger))
    auth = {"Authorization": f"Bearer {ADMIN}"}
    try:
        put = httpx.put(srv.url + "/admin/v1/tenants/acme", headers=auth, json={
            "tiers": ["default", "flex"], "weight": 2,
            "budget": {"amount_usd": 5, "period": "month"},
            "rate_limits": {"requests_per_minute": 100}})
        assert put.status_code == 200, put.text
        assert put.json()["weight"] == 2.0
        made = httpx.post(srv.url + "/admin/v1/tenants/acme/keys", headers=auth).json()
        key = made["key"]
        assert chat(srv, key).status_code == 200
        assert chat(srv, "sk-nobody").status_code == 401  # no open mode with an admin key
        mine = httpx.get(srv.url + "/v1/spend", headers={"Authorization": f"Bearer {key}"})
        figures = mine.json()
        assert figures["tenant"] == "acme" and figures["by_period"]["month"]["spent_usd"] > 0
        assert 0 < figures["budget"]["remaining_usd"] < 5
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'tierserve_tenant_budget_remaining_usd{tenant="acme"}' in metrics
        assert 'tierserve_tenant_spend_usd{period="month",tenant="acme"}' in metrics
        bad = httpx.put(srv.url + "/admin/v1/tenants/acme", headers=auth, json={"weight": -1})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        assert httpx.put(srv.url + "/admin/v1/tenants/acme", json={}).status_code == 401
        keys = httpx.get(srv.url + "/admin/v1/tenants/acme/keys", headers=auth).json()["data"]
        assert [k["id"] for k in keys] == [made["id"]] and "key" not in keys[0]
    finally:
        srv.stop()
    srv = LiveServer(ServerSettings(admin_key=ADMIN, ledger=ledger))  # a restart
    try:
        assert chat(srv, key).status_code == 200  # the key and the tenant were kept
        got = httpx.get(srv.url + "/admin/v1/tenants/acme", headers=auth).json()
        assert got["budget"] == {"amount_usd": 5.0, "period": "month"}
        assert got["tiers"] == ["default", "flex"]
        assert httpx.delete(srv.url + f"/admin/v1/keys/{made['id']}",
                            headers=auth).status_code == 200
        assert chat(srv, key).status_code == 401  # revoked: refused at once
    finally:
        srv.stop()
