"""Several gateways as one (issue 31): four gateways with one PostgreSQL database in front
of the same two real tierserve replicas share a tenant's budget holds and rate-limit
buckets; a gateway killed with SIGKILL leaves holds that stop counting within their
lease. PostgreSQL is a throwaway server (tests/pg.py)."""

import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from fleet_util import MODEL, Gateway, TierserveReplica, free_port, wait_healthy
from pg import pg_database, pg_server  # noqa: F401,F811 (fixtures)
from tierserve.metering import shared
from tierserve.metering.recorder import Budget
from tierserve.server.limits import RateLimit
from tierserve.server.settings import ServerSettings, Tenant
from tierserve.tiers import Tier

PROMPT = "Count: one two three"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    logs = tmp_path_factory.mktemp("replicas")
    reps = [TierserveReplica(logs, "a"), TierserveReplica(logs, "b")]
    try:
        yield [r.wait_ready() for r in reps]
    finally:
        for r in reps:
            r.kill()


def gateways(replicas, database, n, health_interval_s=0.5, **settings):
    return [Gateway([r.spec() for r in replicas], ServerSettings(
        api_keys={"sk-a": Tenant("a")}, database=database, **settings),
        health_interval_s=health_interval_s) for _ in range(n)]


def post(url, max_tokens=MAX_TOKENS, timeout=120):
    return httpx.post(url + "/v1/completions", headers={"Authorization": "Bearer sk-a"},
                      json={"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens,
                            "ignore_eos": True}, timeout=timeout)


def rows(database, sql):
    import psycopg
    with psycopg.connect(database) as db:
        return db.execute(sql).fetchall()


def test_four_gateways_overshoot_a_tiny_budget_by_at_most_one_request(
        replicas, pg_database):  # noqa: F811
    """64 concurrent requests through 4 gateways against a budget of about 10 requests:
    the tenant's total charge stays under budget + one request's worst case, every
    admitted request is billed once, refused ones get 429 insufficient_quota, and no hold
    is left."""
    from tierserve.metering.prices import PriceList
    worst = PriceList().charge(Tier.DEFAULT, len(PROMPT.encode()), 0, MAX_TOKENS)
    budget = 10 * worst
    gws = gateways(replicas, pg_database, 4, budgets={"a": Budget(budget, "day")})
    try:
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            got = list(pool.map(lambda i: post(gws[i % 4].url), range(64)))
        for g in gws:
            g.app.state.tierserve.recorder.ledger.close()  # everything committed
    finally:
        for g in gws:
            g.stop()
    ok = [r for r in got if r.status_code == 200]
    refused = [r for r in got if r.status_code == 429]
    assert len(ok) + len(refused) == 64
    assert all(r.json()["error"]["code"] == "insufficient_quota" for r in refused)
    assert ok and refused
    (count, total), = rows(pg_database, "SELECT count(*), coalesce(sum(charge), 0) FROM "
                                        "requests WHERE tenant = 'a'")
    assert count == len(ok)
    assert total == pytest.approx(sum(r.json()["usage"]["cost"] for r in ok))
    assert total <= budget + worst, (total, budget, worst)
    assert rows(pg_database, "SELECT count(*) FROM holds") == [(0,)]
    dup = rows(pg_database, "SELECT request_id FROM requests GROUP BY request_id "
                            "HAVING count(*) > 1")
    assert dup == []


def test_a_tenant_s_rate_limit_holds_across_gateways(replicas, pg_database):  # noqa: F811
    """8 requests per minute across 4 gateways: 24 sent at once get the bucket's 8 (and
    what refills meanwhile), not 4 x 8; the headers count the shared bucket down."""
    gws = gateways(replicas, pg_database, 4,
                   rate_limits={"a": RateLimit(requests_per_minute=8)})
    try:
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            got = list(pool.map(lambda i: post(gws[i % 4].url, 2), range(24)))
        elapsed = time.monotonic() - start
    finally:
        for g in gws:
            g.stop()
    ok = [r for r in got if r.status_code == 200]
    refill = elapsed * 8 / 60
    assert 8 <= len(ok) <= 8 + int(refill) + 1, (len(ok), elapsed)
    refused = [r for r in got if r.status_code == 429]
    assert all(r.json()["error"]["code"] == "rate_limit_exceeded" for r in refused)
    assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
    remaining = sorted(int(r.headers["x-ratelimit-remaining-requests"]) for r in ok)
    assert remaining[0] == 0 and ok[0].headers["x-ratelimit-limit-requests"] == "8"


def test_a_killed_gateway_s_holds_stop_counting_within_their_lease(
        replicas, pg_database, tmp_path, monkeypatch):  # noqa: F811
    """A gateway (its own process, lease 3 s) holds budget for 6 long requests and is
    killed with SIGKILL: its clients' connections fail (nothing is left waiting), its holds
    stop counting within the lease, and another gateway then admits the tenant again."""
    from tierserve.metering.prices import PriceList
    monkeypatch.setattr(shared, "LEASE_S", 3.0)  # this process's gateway renews often too
    worst = PriceList().charge(Tier.DEFAULT, len(PROMPT.encode()), 0, 400)
    budget = 6.5 * worst  # six long requests hold all of it
    config = tmp_path / "gw.yaml"
    config.write_text(f"api_keys: {{sk-a: {{tenant: a}}}}\nbudgets: {{a: {{amount_usd: "
                      f"{budget!r}, period: day}}}}\n")
    port = free_port()
    log = open(tmp_path / "gateway.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierserve.cli", "serve", "--port", str(port), "--config",
         str(config), "--database", pg_database, "--no-batches",
         *sum((["--backend", r.url] for r in replicas), [])],
        env={**os.environ, "TIERSERVE_LEASE_S": "3"}, stdout=log, stderr=log,
        start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, tmp_path / "gateway.log")
        pool = concurrent.futures.ThreadPoolExecutor(6)
        long = [pool.submit(post, url, 400, 60) for _ in range(6)]
        deadline = time.time() + 30
        while rows(pg_database, "SELECT count(*) FROM holds")[0][0] < 6:
            assert time.time() < deadline, "the holds never appeared"
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        for f in long:  # each client learns at once that its gateway is gone
            with pytest.raises(httpx.HTTPError):
                f.result(timeout=30)
        pool.shutdown()
        [other] = gateways(replicas, pg_database, 1, budgets={"a": Budget(budget, "day")})
        try:
            live = "SELECT count(*) FROM holds WHERE lease_until > " \
                   "extract(epoch from clock_timestamp())"
            while rows(pg_database, live)[0][0]:
                assert time.monotonic() - killed < 3.0 + 1.0, "holds outlived their lease"
                time.sleep(0.1)
            assert post(other.url).status_code == 200  # the budget is free again
            deadline = time.time() + 10  # the survivor's renewal deletes the dead rows
            while rows(pg_database, "SELECT count(*) FROM holds")[0][0]:
                assert time.time() < deadline, "expired holds were not deleted"
                time.sleep(0.2)
        finally:
            other.stop()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_load_counted_before_a_grant_never_lowers_the_granted_row(pg_database):  # noqa: F811
    """A gateway counts 3 lower-tier requests on a replica for its next exchange, and a
    release takes a 4th slot before the exchange writes: the row stays 4, so another
    gateway finds the limit of 4 full. The next exchange, counted after the grant,
    publishes the drop to 3, and the other gateway gets its slot. A request moved there
    (Envoy's retry) raises the row as a grant does."""
    from tierserve.metering.ledger import connect
    connect(pg_database).close()  # the tables
    a, b = shared.SharedState(pg_database), shared.SharedState(pg_database)
    url = "http://127.0.0.1:1"
    try:
        granted = dict(a.granted)  # counted: 3 in flight
        assert a.acquire_lower(url, 3, 4)  # a release on A's loop meanwhile
        a.exchange_loads({url: 3}, granted)  # the stale count: not written
        assert b.exchange_loads({url: 0}) == {url: 4}
        assert not b.acquire_lower(url, 0, 4)
        a.exchange_loads({url: 3}, dict(a.granted))  # one of A's four finished
        assert b.acquire_lower(url, 0, 4)
        assert not a.acquire_lower(url, 3, 4)  # 3 + B's 1: full
        granted = dict(a.granted)  # counted: 3 again
        a.raise_lower(url, 4)  # Envoy moved one of A's requests there meanwhile
        a.exchange_loads({url: 3}, granted)
        assert b.exchange_loads({url: 1}) == {url: 4}
    finally:
        a.close()
        b.close()


def test_two_gateways_keep_one_lower_tier_limit_per_replica(replicas, pg_database):  # noqa: F811
    """One replica of 6 slots, 2 kept for priority (a lower-tier limit of 4): gateway A
    floods it with default work, then gateway B does too. B sees A's 4 on the replica
    and releases none of its own until they drain, so the two together never pass the
    limit (each alone would allow 4: 8 in all); a priority request through B still goes
    at once."""
    import threading

    from tierserve.router.flow import FlowConfig
    spec = [replicas[0].spec(max_num_seqs=6)]
    settings = [ServerSettings(database=pg_database) for _ in range(2)]
    a, b = (Gateway(spec, s, flow=FlowConfig(reserved_priority_seqs=2)) for s in settings)
    # Both gateways' lower-tier requests on the replica, counted together under one lock
    # as each gateway's loop sends and finishes them: up before a request is sent, down
    # after it has finished, so the count is never below the truth, and reading two
    # counters from a third thread cannot see one before and one after a change.
    lock, both, samples = threading.Lock(), [0, 0], []

    def count(i, flow):
        sent, finished = flow.sent, flow.finished

        def on_sent(request, replica, now):
            if request.tier != Tier.PRIORITY:
                with lock:
                    both[i] += 1
                    samples.append(tuple(both))
            sent(request, replica, now)

        def on_finished(request, *args, **kwargs):
            lower = request.replica is not None and request.tier != Tier.PRIORITY
            finished(request, *args, **kwargs)
            if lower:
                with lock:
                    both[i] -= 1
        flow.sent, flow.finished = on_sent, on_finished

    count(0, a.backend.gateway)
    count(1, b.backend.gateway)
    ra = a.backend.gateway.replicas[0]

    def flood(gw, n):
        return [pool.submit(lambda: httpx.post(gw.url + "/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 48, "ignore_eos": True}))
            for _ in range(n)]

    pool = concurrent.futures.ThreadPoolExecutor(24)
    try:
        first = flood(a, 8)
        deadline = time.time() + 30
        while ra.lower_in_flight < 4:
            assert time.time() < deadline
            time.sleep(0.01)
        time.sleep(0.5)  # A's count reaches B (every 0.1 s)
        second = flood(b, 8)
        fast = httpx.post(b.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 2, "service_tier": "priority"})
        assert fast.status_code == 200
        assert all(f.result().status_code == 200 for f in first + second)
    finally:
        pool.shutdown()
        a.stop()
        b.stop()
    # each release takes a slot of the shared limit first: never more than 4 together
    assert len(samples) >= 16 and both == [0, 0]
    assert max(x + y for x, y in samples) <= 4, max(samples, key=sum)
    assert max(y for _, y in samples) >= 1  # B did run its share, once A's drained


def test_a_batch_outlives_the_gateway_running_it_each_line_once(replicas, pg_database,  # noqa: F811
                                                                  tmp_path, monkeypatch):
    """Gateway A (its own process, leases of 3 s) runs a 10-line batch two lines at a time
    and is killed with SIGKILL mid-batch; gateway B (same database and data directory)
    claims A's lines once their leases run out and finishes the batch: every line done
    once, one output line and one ledger row each."""
    import json

    from tierserve.batch import runner
    monkeypatch.setattr(runner, "LEASE_S", 3.0)
    data = tmp_path / "data"
    port = free_port()
    log = open(tmp_path / "a.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierserve.cli", "serve", "--port", str(port), "--database",
         pg_database, "--data-dir", str(data), "--batch-max-in-flight", "2",
         *sum((["--backend", r.url] for r in replicas), [])],
        env={**os.environ, "TIERSERVE_LEASE_S": "3"}, stdout=log, stderr=log,
        start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    b = None
    try:
        wait_healthy(proc, url, tmp_path / "a.log")
        lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                             "body": {"model": MODEL, "prompt": f"Item {i}:", "max_tokens": 40,
                                      "ignore_eos": True}}) for i in range(10)]
        f = httpx.post(url + "/v1/files", files={"file": ("in.jsonl", "\n".join(lines))},
                       data={"purpose": "batch"}, timeout=30).json()
        batch = httpx.post(url + "/v1/batches", timeout=30, json={
            "input_file_id": f["id"], "endpoint": "/v1/completions",
            "completion_window": "24h"}).json()
        deadline = time.time() + 120
        while httpx.get(f"{url}/v1/batches/{batch['id']}", timeout=10).json()[
                "request_counts"]["completed"] < 2:
            assert time.time() < deadline, "A ran no line"
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)  # mid-batch: two lines claimed and running
        held = rows(pg_database, "SELECT count(*) FROM lines WHERE state = 'pending' AND "
                                 "claimed_by IS NOT NULL")[0][0]
        assert held >= 1
        b = Gateway([r.spec() for r in replicas],
                    ServerSettings(database=pg_database, data_dir=str(data)))
        deadline = time.time() + 180
        while True:
            got = httpx.get(f"{b.url}/v1/batches/{batch['id']}", timeout=10).json()
            if got["status"] in ("completed", "failed", "expired", "cancelled"):
                break
            assert time.time() < deadline, got
            time.sleep(0.3)
        assert got["status"] == "completed", got
        assert got["request_counts"] == {"total": 10, "completed": 10, "failed": 0}
        out = [json.loads(x) for x in httpx.get(
            f"{b.url}/v1/files/{got['output_file_id']}/content", timeout=10).text.splitlines()]
        assert sorted(o["custom_id"] for o in out) == sorted(f"c{i}" for i in range(10))
        mine = b.app.state.tierserve.batches.runner.name
        assert rows(pg_database, f"SELECT count(*) FROM lines WHERE claimed_by = '{mine}'"
                    )[0][0] >= held  # B ran what A held when it died
        billed = rows(pg_database, "SELECT request_id, count(*) FROM requests WHERE "
                                   "request_id LIKE 'batch_req_%' GROUP BY request_id")
        assert len(billed) == 10 and all(n == 1 for _, n in billed)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if b is not None:
            b.stop()


HAPROXY = """global
    maxconn 512
defaults
    mode http
    timeout connect 5s
    timeout client 120s
    timeout server 120s
frontend tierserve
    bind 127.0.0.1:{port}
    default_backend gateways
backend gateways
    balance roundrobin
    option httpchk GET /health
{servers}
"""


def test_two_gateways_behind_haproxy_share_one_budget(replicas, pg_database, tmp_path):  # noqa: F811
    """The README's deployment: two gateways with one --database behind HAProxy (Debian's
    package; CI installs it). Requests alternate between them, and the tenant's budget
    is one: the two together stop it at budget + one worst case."""
    import shutil

    from tierserve.metering.prices import PriceList
    if shutil.which("haproxy") is None:
        if os.environ.get("CI", "").lower() in ("1", "true"):
            pytest.fail("haproxy is not installed (.ci/run installs Debian's package)")
        pytest.skip("haproxy is not installed (apt-get install haproxy)")
    worst = PriceList().charge(Tier.DEFAULT, len(PROMPT.encode()), 0, MAX_TOKENS)
    # the gateways' default health interval (2 s, each probe's timeout too): with the
    # suite's 0.5 s a probe answered late under the full run's load marked both replicas
    # down and a request was refused for that, not for the budget (once, fresh-clone CI)
    gws = gateways(replicas, pg_database, 2, health_interval_s=2.0,
                   budgets={"a": Budget(4 * worst, "day")})
    port = free_port()
    servers = "\n".join(f"    server g{i} 127.0.0.1:{g.port} check inter 500"
                        for i, g in enumerate(gws))
    (tmp_path / "haproxy.cfg").write_text(HAPROXY.format(port=port, servers=servers))
    proxy = subprocess.Popen(["haproxy", "-db", "-f", str(tmp_path / "haproxy.cfg")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 30
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "haproxy not up"
            time.sleep(0.2)
        got = [post(url) for _ in range(12)]  # one at a time: round robin alternates
        for g in gws:
            g.app.state.tierserve.recorder.ledger.close()
        served = [sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(
            g.url + "/metrics", timeout=10).text.splitlines()
            if line.startswith("tierserve_request_finished_total{")) for g in gws]
    finally:
        os.killpg(proxy.pid, signal.SIGKILL)
        for g in gws:
            g.stop()
    ok = [r for r in got if r.status_code == 200]
    assert all(r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"
               for r in got if r.status_code != 200)
    assert 1 <= len(ok) < 12 and all(s >= 1 for s in served), (len(ok), served)
    (total,), = rows(pg_database, "SELECT coalesce(sum(charge), 0) FROM requests")
    assert total <= 4 * worst + worst
