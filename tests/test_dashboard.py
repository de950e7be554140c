"""The dashboard in a real headless Chromium under live load, and the dashboards operators
already have: vLLM's Grafana dashboard and ours, every query checked against /metrics.

The browser is Debian's `chromium` driven by Playwright with its executable path (no
browser download). Where no chromium is installed the browser test skips, unless
TIERSERVE_REQUIRE_BROWSER is set (CI sets it, so there it fails instead).
"""

import io
import json
import os
import re
import shutil
import sqlite3
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from test_batch import jsonl, request_line
from test_server import MODEL, LiveServer
from tierserve.metering.recorder import Budget
from tierserve.server.settings import ServerSettings, Tenant

ADMIN = "admin-key-for-the-dashboard-test"
ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(os.environ.get("TIERSERVE_ARTIFACTS", ROOT / "test-artifacts"))
PANELS = ("ttft", "itl", "tokens", "queue", "batch", "phase", "kv", "cost", "tenants",
          "batches", "units")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("dash")
    srv = LiveServer(ServerSettings(
        api_keys={"sk-a": Tenant("a"), "sk-b": Tenant("b")}, admin_key=ADMIN,
        budgets={"b": Budget(5.0, "day")}, ledger=str(root / "ledger.db"),
        data_dir=str(root / "data")), max_num_seqs=8,
        slo={"priority": {"ttft_s": 2.0, "tpot_s": 0.5}, "default": {"ttft_s": 10.0}})
    srv.ledger = root / "ledger.db"
    yield srv
    srv.stop()


def send(srv, key, tier, stream=False, max_tokens=12):
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "service_tier": tier,
            "stream": stream, "messages": [{"role": "user", "content": f"Tell me about {tier}."}]}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200, r.read()
        r.read()


class Load:
    """Requests in every tier from two tenants, some streamed, until stopped."""

    def __init__(self, srv):
        self.srv, self.stopping, self.sent = srv, threading.Event(), 0
        self.started = time.time()
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True)
                        for i in range(3)]
        for t in self.threads:
            t.start()

    def run(self, i):
        tiers = ("priority", "default", "flex")
        while not self.stopping.is_set():
            send(self.srv, ("sk-a", "sk-b")[self.sent % 2], tiers[(self.sent + i) % 3],
                 stream=self.sent % 3 == 0)
            self.sent += 1

    def stop(self):
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=120)


def metrics(srv) -> dict[tuple, float]:
    text = httpx.get(srv.url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def by_tier(samples, name) -> dict[str, float]:
    out = {}
    for (n, labels), value in samples.items():
        if n == name:
            tier = dict(labels)["tier"]
            out[tier] = out.get(tier, 0.0) + value
    return out


def test_the_dashboard_needs_the_admin_key(server):
    r = httpx.get(server.url + "/dashboard")
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic")
    r = httpx.get(server.url + "/dashboard/data", headers={"Authorization": "Bearer sk-a"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/dashboard/data", auth=("any", ADMIN)).status_code == 200
    assert httpx.get(server.url + "/dashboard", headers={
        "Authorization": f"Bearer {ADMIN}"}).status_code == 200
    assert httpx.get(server.url + "/dashboard/static/../app.py").status_code == 404


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("TIERSERVE_REQUIRE_BROWSER"):
            pytest.fail("no chromium on PATH (apt-get install chromium)")
        pytest.skip("no chromium on PATH (apt-get install chromium)")
    return path


def test_every_panel_renders_live_data_that_agrees_with_metrics_and_the_ledger(server):
    sync_api = pytest.importorskip("playwright.sync_api")
    exe = chromium()
    client = server.client("sk-a")
    upload = client.files.create(file=("d.jsonl", io.BytesIO(jsonl(
        [request_line(i) for i in range(6)]))), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    load = Load(server)
    hosts = []
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
            page = browser.new_context(http_credentials={"username": "ops", "password": ADMIN},
                                       viewport={"width": 1400, "height": 1800}).new_page()
            page.on("request", lambda r: hosts.append(r.url))
            page.goto(server.url + "/dashboard")
            ready = " && ".join(f'document.querySelector(\'[data-panel="{p}"]\').dataset.ready'
                                f' === "1"' for p in PANELS)
            page.wait_for_function(ready, timeout=120_000)
            time.sleep(max(0.0, load.started + 15 - time.time()))  # charts of a real load
            load.stop()
            server.wait_idle()
            deadline = time.time() + 60  # the batch's lines finish, then two more polls
            while client.batches.retrieve(batch.id).status != "completed":
                assert time.time() < deadline
                time.sleep(0.2)
            time.sleep(1.0)
            seen = int(page.evaluate("document.body.dataset.updates"))
            page.wait_for_function(f"Number(document.body.dataset.updates) >= {seen + 2}",
                                   timeout=20_000)
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
            cells = page.evaluate("""() => [...document.querySelectorAll('td[data-field]')]
                .map(td => [td.closest('[data-panel]').dataset.panel,
                            td.parentElement.dataset.row, td.dataset.field,
                            td.dataset.value ?? td.textContent])""")
            browser.close()
    finally:
        load.stop()
    assert all(u.startswith(server.url + "/") for u in hosts), hosts
    table = {(panel, row, field): value for panel, row, field, value in cells}
    samples = metrics(server)
    for field, name in (("requests", "tierserve_request_finished_total"),
                        ("output_tokens", "tierserve_generation_tokens_total"),
                        ("machine_cost_usd", "tierserve_machine_cost_usd_total")):
        expected = by_tier(samples, name)
        assert set(expected) >= {"priority", "default", "flex", "batch"}
        for tier, value in expected.items():
            assert float(table["cost", tier, field]) == pytest.approx(value, rel=1e-9), field
    with sqlite3.connect(server.ledger) as db:
        spent = dict(db.execute("SELECT tenant, SUM(charge) FROM requests GROUP BY tenant"))
    assert set(spent) == {"a", "b"}
    for tenant, charge in spent.items():
        assert float(table["tenants", tenant, "spent_total_usd"]) == pytest.approx(charge)
    assert float(table["tenants", "b", "remaining_usd"]) == pytest.approx(5.0 - spent["b"])
    assert table["batches", batch.id, "status"] == "completed"
    assert float(table["batches", batch.id, "completed"]) == 6
    assert table["units", "0", "healthy"] == "healthy"


SELECTOR = re.compile(r'\b((?:vllm:|tierserve_)[a-zA-Z0-9_:]*)(?:\{([^}]*)\})?')
"""A series selector of either family (function names and `by` labels never match)."""
MATCHER = re.compile(r'(\w+)\s*=\s*"([^"]*)"')


def series_missing(expr: str, samples, variables: dict) -> list[str]:
    """The selectors of a PromQL expression that match no sample of the scrape."""
    for var, value in variables.items():
        expr = expr.replace(var, value)
    found = SELECTOR.findall(expr)
    if expr.startswith("label_values("):  # a templating query: any series with the label
        label = expr[len("label_values("):-1].split(",")[-1].strip()
        name = expr[len("label_values("):-1].split(",")[0].strip() if "," in expr else None
        ok = any(label in dict(lbl) and (name is None or n == name) for n, lbl in samples)
        return [] if ok else [expr]
    assert found, f"no selector in {expr}"
    missing = []
    for name, matchers in found:
        want = dict(MATCHER.findall(matchers))
        if not any(n == name and want.items() <= dict(lbl).items() for n, lbl in samples):
            missing.append(f"{name}{{{matchers}}}")
    return missing


def test_vllm_and_tierserve_grafana_queries_all_resolve_against_metrics(server):
    for tier in ("priority", "default"):
        send(server, "sk-a", tier, stream=True)
    server.wait_idle()
    time.sleep(0.2)
    samples = metrics(server)
    vllm = [line for line in (ROOT / "tests/data/vllm_grafana_queries.txt").read_text()
            .splitlines() if line and not line.startswith("#")]
    missing = [m for q in vllm for m in series_missing(q, samples, {"$model_name": MODEL})]
    assert not missing, missing
    ours = json.loads((ROOT / "deploy/grafana/tierserve.json").read_text())
    queries = [t["expr"] for panel in ours["panels"] for t in panel["targets"]]
    queries += [v["query"]["query"] for v in ours["templating"]["list"] if v["type"] == "query"]
    missing = [m for q in queries for m in series_missing(q, samples, {"$model": MODEL})]
    assert not missing, missing
