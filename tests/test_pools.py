"""One gateway, several models: `tierserve serve` (the real CLI, its own process) in front
of two real tierserve replicas serving different model names, with YAML aliases, a route
across the pools and a fallback. The replicas run the same weights under two names: what
is checked is where requests go and what is billed, not what the models answer."""

import os
import sqlite3
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from fleet_util import TierserveReplica, free_port, wait_healthy

SMALL, LARGE = "small", "large"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("pools")
    reps = {SMALL: TierserveReplica(root, SMALL, "--served-model-name", SMALL),
            LARGE: TierserveReplica(root, LARGE, "--served-model-name", LARGE)}
    gw = None
    try:
        for r in reps.values():
            r.wait_ready()
        config = {
            # the first replica's model is the main one; both models learned from replicas
            "backends": [reps[SMALL].url + "/v1", reps[LARGE].url],
            "aliases": {"fast": SMALL, "big": LARGE},
            "fallbacks": {LARGE: SMALL},
            "routes": {"auto": [
                {"name": "short", "when": {"max_tokens_max": 4}, "model": SMALL,
                 "tier": "priority"},
                {"name": "rest", "model": LARGE, "tier": "default"}]},
            "fleet": {"health_interval_s": 0.5},
        }
        (root / "gw.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        port = free_port()
        log = open(root / "gateway.log", "wb")
        gw = subprocess.Popen(
            [sys.executable, "-m", "tierserve.cli", "serve", "--config", str(root / "gw.yaml"),
             "--port", str(port), "--ledger", str(root / "ledger.db"), "--no-batches",
             "--machine-price-per-hour", "3.6"],
            stdout=log, stderr=log, start_new_session=True, env={**os.environ})
        url = f"http://127.0.0.1:{port}"
        wait_healthy(gw, url, root / "gateway.log", 120)
        yield {"url": url, "reps": reps, "root": root, "log": root / "gateway.log"}
    finally:
        if gw is not None:
            gw.terminate()
            gw.wait(timeout=30)
        for r in reps.values():
            r.kill()


def ask(fleet, model, max_tokens=3, **extra):
    return httpx.post(fleet["url"] + "/v1/completions", timeout=120, json={
        "model": model, "prompt": "Hello there", "max_tokens": max_tokens,
        "temperature": 0, **extra})


def replica_rows(fleet, name) -> int:
    """Requests a replica has served (its own /metrics)."""
    text = httpx.get(fleet["reps"][name].url + "/metrics", timeout=10).text
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("tierserve_request_finished_total{")))


def test_the_gateway_learns_both_pools_and_lists_models_and_aliases(fleet):
    log = fleet["log"].read_text()
    assert "answered: tierserve (detected), serves small (learned); 16 slots (from its " \
        "model card)" in log
    assert "no priority SLO configured; the fast lane's target is 1.5x" in log
    data = httpx.get(fleet["url"] + "/v1/models", timeout=10).json()["data"]
    cards = {m["id"]: m for m in data}
    assert list(cards) == [SMALL, LARGE, "fast", "big", "auto"]
    assert cards["fast"]["alias_of"] == SMALL and cards["big"]["alias_of"] == LARGE
    assert cards[SMALL]["max_num_seqs"] == 16
    assert cards["auto"]["routes_to"] == [LARGE, SMALL]
    r = ask(fleet, "medium")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "`small`, `large`, `fast`, `big`, `auto`" in err["message"]


def test_requests_go_to_the_pool_of_their_model_alias_or_route(fleet):
    before = {n: replica_rows(fleet, n) for n in (SMALL, LARGE)}
    for model, pool in ((SMALL, SMALL), (LARGE, LARGE), ("fast", SMALL), ("big", LARGE)):
        r = ask(fleet, model)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == pool
    short = ask(fleet, "auto", max_tokens=2)
    assert short.headers["x-tierserve-route"] == "route=auto/short; model=small"
    assert short.headers["x-tierserve-served-tier"] == "priority"
    long = ask(fleet, "auto", max_tokens=6)
    assert long.headers["x-tierserve-route"] == "route=auto/rest; model=large"
    after = {n: replica_rows(fleet, n) for n in (SMALL, LARGE)}
    assert after[SMALL] - before[SMALL] == 3 and after[LARGE] - before[LARGE] == 3
    metrics = httpx.get(fleet["url"] + "/metrics", timeout=10).text
    assert 'tierserve_request_finished_total{finish_reason="length",model="large",tier="default"}' \
        in metrics
    units = httpx.get(fleet["url"] + "/dashboard/data", timeout=10).json()["units"]
    assert {(u["model"], u["name"]) for u in units} == {(SMALL, "small/r0"), (LARGE, "large/r1")}


def test_a_dead_pool_falls_back_billed_once_and_labelled(fleet):
    """The large pool's only replica is killed: requests for it go to the small model,
    say so in a header, the ledger and the metrics; each is billed once; a model with no
    fallback named fails with a clear 503."""
    fleet["reps"][LARGE].kill()
    deadline = time.time() + 20  # the health check (0.5 s), or a request that fails, finds it
    while not ask(fleet, LARGE).headers.get("x-tierserve-fallback-from"):
        assert time.time() < deadline, "no fallback after the large replica died"
        time.sleep(0.2)
    got = [ask(fleet, m) for m in (LARGE, "big", LARGE)]
    for r in got:
        assert r.status_code == 200, r.text
        assert r.json()["model"] == SMALL
        assert r.headers["x-tierserve-fallback-from"] == "large (down)"
    metrics = httpx.get(fleet["url"] + "/metrics", timeout=10).text
    line = next(x for x in metrics.splitlines()
                if x.startswith('tierserve_fallbacks_total{model="large",reason="down"'))
    assert float(line.rsplit(" ", 1)[1]) >= 3
    time.sleep(1.0)  # the ledger's writer
    db = sqlite3.connect(fleet["root"] / "ledger.db")
    ids = [r.json()["id"] for r in got]
    rows = db.execute(f"SELECT request_id, model, tags FROM requests WHERE request_id IN "
                      f"({','.join('?' * len(ids))})", ids).fetchall()
    assert sorted(r[0] for r in rows) == sorted(ids)  # each once
    assert all(r[1] == SMALL and '"fallback_from": "large (down)"' in r[2] for r in rows)
    dup = db.execute("SELECT request_id, COUNT(*) FROM requests GROUP BY request_id "
                     "HAVING COUNT(*) > 1").fetchall()
    assert dup == []
    # the health check says which pool is down; a model with nothing to fall back to: 503
    fleet["reps"][SMALL].kill()
    deadline = time.time() + 20
    while time.time() < deadline:
        r = ask(fleet, SMALL)
        if r.status_code == 503:
            break
        time.sleep(0.3)
    assert r.status_code == 503 and r.json()["error"]["code"] == "replica_unavailable"


def test_pool_aliases_and_fallbacks_config_is_checked_with_the_bad_field_named():
    from tierserve.errors import ConfigError
    from tierserve.server.pools import add_aliases, group_pools, parse_fallbacks
    from tierserve.server.settings import ServerSettings

    settings = ServerSettings(backends=ServerSettings.parse_backends([
        {"url": "http://127.0.0.1:1", "models": ["a", "a-alias"]},
        {"url": "http://127.0.0.1:2", "models": ["b"]},
        {"url": "http://127.0.0.1:3", "models": ["a"]}]))
    group_pools(settings, {"pools": {"b": {"priority_ttft_s": 0.5}}}, "a")
    assert {k: [s.name for s in v] for k, v in settings.pools.items()} == \
        {"a": ["r0", "r2"], "b": ["r1"]}
    assert settings.aliases == {"a-alias": "a"}
    with pytest.raises(ConfigError, match="pools: no replica serves 'c'"):
        group_pools(settings, {"pools": {"c": {}}}, "a")
    with pytest.raises(ConfigError, match=r"pools.b: unknown key 'ttft'"):
        group_pools(settings, {"pools": {"b": {"ttft": 1}}}, "a")
    with pytest.raises(ConfigError, match=r"pools.b.priority_ttft_s must be a number > 0"):
        group_pools(settings, {"pools": {"b": {"priority_ttft_s": -1}}}, "a")
    with pytest.raises(ConfigError, match=r"aliases.x: 'zz' is not a served model"):
        add_aliases(settings, {"x": "zz"}, {"a", "b"})
    with pytest.raises(ConfigError, match="is a model or route already"):
        add_aliases(settings, {"b": "a"}, {"a", "b"})
    assert parse_fallbacks({"a-alias": "b"}, {"a", "b"}, settings.aliases) == {"a": ["b"]}
    with pytest.raises(ConfigError, match="'c' is not a served model"):
        parse_fallbacks({"a": ["c"]}, {"a", "b"}, {})
    with pytest.raises(ConfigError, match="cannot fall back to itself"):
        parse_fallbacks({"a": "a"}, {"a", "b"}, {})
    # --served-model-name renames the first replica's pool
    renamed = ServerSettings(backends=ServerSettings.parse_backends([
        {"url": "http://127.0.0.1:1", "models": ["a"]}]))
    group_pools(renamed, {}, "chat")
    assert list(renamed.pools) == ["chat"]
