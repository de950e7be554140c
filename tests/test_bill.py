"""`tierserve bill`: on a hand-made ledger (findings) and on one from a real mixed run."""

import csv
import io
import json
import threading

import httpx
import pytest

from tierserve.cli import main
from tierserve.metering.ledger import Ledger, RequestRow, connect


def make_row(i, tier, out_tokens, cost, tenant="t"):
    return RequestRow(time=1_800_000_000.0 + i, request_id=f"r{i}", tenant=tenant, model="m",
                      tier_requested=tier, tier_served=tier, prompt_tokens=100,
                      cached_tokens=0, output_tokens=out_tokens, queue_s=0.0, prefill_s=0.1,
                      decode_s=1.0, prefill_cost=cost / 4, decode_cost=3 * cost / 4,
                      charge=cost / 2, finish_reason="length", tags={"app": f"a{i % 2}"},
                      mean_batch_size=1.0 if tier == "priority" else 32.0, ttft_s=0.05,
                      e2e_s=1.1)


def test_findings_tell_the_fast_mode_story(tmp_path, capsys):
    ledger = Ledger(tmp_path / "l.db")
    for i in range(10):   # 10 short priority requests: 300 tokens, $0.31 of machine time
        ledger.record(make_row(i, "priority", 30, 0.031))
    for i in range(10, 20):  # 10 long batched ones: 9700 tokens, $0.69
        ledger.record(make_row(i, "default", 970, 0.069))
    ledger.record_idle(1_800_000_000.0, 1_800_000_060.0, "m", 0.0, 0.0)
    ledger.close()
    assert main(["bill", "--ledger", str(tmp_path / "l.db"), "--format", "json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["totals"]["machine_cost"] == pytest.approx(1.0)
    story = summary["findings"][0]
    assert story.startswith("priority requests with <64 output tokens were 3% of output "
                            "tokens and 31% of machine cost")
    # at default's $0.069/970 per token, 300 tokens would have cost $0.0213: $0.2887 less
    assert "at default's cost per token they would have cost $0.2887 less" in story
    assert any("Charges covered 50%" in f for f in summary["findings"])
    assert main(["bill", "--ledger", str(tmp_path / "l.db"), "--by", "tag:app"]) == 0
    table = capsys.readouterr().out
    assert "a0" in table and "a1" in table and "findings:" in table


def test_bill_errors_are_one_line(tmp_path, capsys):
    assert main(["bill", "--ledger", str(tmp_path / "missing.db")]) == 1
    assert "no ledger at" in capsys.readouterr().err
    Ledger(tmp_path / "l.db").close()
    assert main(["bill", "--ledger", str(tmp_path / "l.db"), "--since", "yesterday"]) == 1
    assert "cannot read the time 'yesterday'" in capsys.readouterr().err
    assert main(["bill", "--ledger", str(tmp_path / "l.db"), "--by", "colour"]) == 1


def test_bill_of_a_real_mixed_tier_run(tmp_path, capsys):
    from test_server import MODEL, LiveServer
    from tierserve.server.settings import ServerSettings
    path = tmp_path / "l.db"
    srv = LiveServer(ServerSettings(ledger=str(path)))
    try:
        def post(tier, n):
            httpx.post(srv.url + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": "Write about the sea.", "max_tokens": n,
                "ignore_eos": True, "service_tier": tier})
        threads = [threading.Thread(target=post, args=(t, n)) for t, n in
                   [("priority", 8)] * 3 + [("default", 40)] * 2 + [("flex", 40)] * 2]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        srv.wait_idle()
    finally:
        srv.stop()  # flushes the last idle interval and closes the ledger
    assert main(["bill", "--ledger", str(path), "--format", "json",
                 "--plot", str(tmp_path / "bill.png")]) == 0
    summary = json.loads(capsys.readouterr().out)
    db = connect(path)
    rows_cost = db.execute("SELECT sum(prefill_cost + decode_cost), sum(charge), count(*) "
                           "FROM requests").fetchone()
    idle = db.execute("SELECT coalesce(sum(cost + reserved_cost), 0) FROM idle").fetchone()[0]
    t = summary["totals"]
    assert t["requests"] == rows_cost[2] == 7
    assert t["machine_cost"] == pytest.approx(rows_cost[0] + idle, rel=1e-9)
    assert t["charge"] == pytest.approx(rows_cost[1], rel=1e-9)
    assert {g["tier"] for g in summary["groups"]} == {"priority", "default", "flex"}
    assert sum(g["requests"] for g in summary["groups"]) == 7
    assert (tmp_path / "bill.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["bill", "--ledger", str(path), "--format", "csv", "--by", "size"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert sum(int(r["requests"]) for r in rows) == 7
