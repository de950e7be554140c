"""Batch jobs: /v1/files and /v1/batches through real HTTP on 127.0.0.1, on the real default
model, with the official `openai` client; durability across a SIGKILL in a subprocess."""

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from test_server import LiveServer
from tierserve.cli import main
from tierserve.metering.ledger import connect
from tierserve.server.settings import ServerSettings, Tenant
from tierserve.tiers import Tier

openai = pytest.importorskip("openai")
MODEL = "smol"


def request_line(i: int, max_tokens: int = 8, url: str = "/v1/chat/completions", **extra):
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, **extra}
    if url == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": f"Say the number {i}."}]
    else:
        body["prompt"] = f"Count: {i},"
    return {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}


def jsonl(lines) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def wait_final(client, batch_id: str, timeout: float = 180):
    deadline = time.time() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert time.time() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.2)


def read_lines(client, file_id) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    settings = ServerSettings(
        data_dir=str(root / "data"), ledger=str(root / "ledger.db"), max_file_bytes=64 * 1024,
        max_batch_lines=60, batch_max_in_flight=24, api_keys={"sk-a": Tenant("team-a"), "sk-b": Tenant("team-b"),
                                      "sk-i": Tenant("interactive", ["priority", "default"])})
    srv = LiveServer(settings, max_num_seqs=16)
    srv.root = root
    yield srv
    srv.stop()


def test_openai_client_runs_a_50_line_batch(server):
    client = server.client("sk-a")
    lines = [request_line(i) for i in range(50)]
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "nightly"})
    assert batch.status == "in_progress" and batch.request_counts.total == 50
    batch = wait_final(client, batch.id)
    assert batch.status == "completed", batch.errors
    assert batch.request_counts.completed == 50 and batch.request_counts.failed == 0
    assert batch.error_file_id is None and batch.metadata == {"job": "nightly"}
    out = read_lines(client, batch.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(50))
    for line in out:
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and line["error"] is None
        assert body["service_tier"] == "batch" and body["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] >= 1
        assert body["usage"]["cost"] > 0
    # the same request alone gives the same text: a batch line is an ordinary request
    alone = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                           messages=lines[7]["body"]["messages"])
    line7 = next(x for x in out if x["custom_id"] == "req-7")
    assert alone.choices[0].message.content == \
        line7["response"]["body"]["choices"][0]["message"]["content"]
    total_out = sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out)
    data = client.batches.retrieve(batch.id).model_dump()
    assert data["usage"]["output_tokens"] == total_out and data["cost"]["charge_usd"] > 0
    # the ledger tags every line with the batch id, charged in the batch tier
    server.wait_idle()
    time.sleep(0.6)  # the ledger commits every 0.25 s
    db = connect(server.root / "ledger.db")
    rows = db.execute("SELECT tier_served, tenant, charge, output_tokens, request_id FROM "
                      "requests WHERE json_extract(tags, '$.batch_id') = ?",
                      (batch.id,)).fetchall()
    # one request id per line: its ledger row, its output line and its response
    assert {r[4] for r in rows} == {x["id"] for x in out} == \
        {x["response"]["request_id"] for x in out} == {x["response"]["body"]["id"] for x in out}
    assert len(rows) == 50 and {r[0] for r in rows} == {"batch"} and {r[1] for r in rows} == \
        {"team-a"}
    assert sum(r[3] for r in rows) == total_out
    assert sum(r[2] for r in rows) == pytest.approx(data["cost"]["charge_usd"], rel=1e-6)


def test_a_bad_body_fails_alone_and_completions_endpoint(server):
    client = server.client("sk-a")
    lines = [request_line(i, url="/v1/completions") for i in range(3)]
    lines[1]["body"]["max_tokens"] = -1
    lines[2]["body"]["model"] = "no-such-model"
    f = client.files.create(file=("c.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = wait_final(client, client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="24h").id)
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 2)
    out, err = read_lines(client, batch.output_file_id), read_lines(client, batch.error_file_id)
    assert [x["custom_id"] for x in out] == ["req-0"]
    assert out[0]["response"]["body"]["object"] == "text_completion"
    by_id = {x["custom_id"]: x["response"] for x in err}
    assert by_id["req-1"]["status_code"] == 400
    assert "max_tokens" in by_id["req-1"]["body"]["error"]["message"]
    assert by_id["req-2"]["status_code"] == 404


def test_malformed_files_and_bad_requests(server):
    client = server.client("sk-a")
    with pytest.raises(openai.BadRequestError, match="line 2 is not valid JSON"):
        client.files.create(file=("x.jsonl", io.BytesIO(b'{"a": 1}\n{oops\n')), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", io.BytesIO(b'{"a": 1}\n')), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="more than 60 requests"):
        client.files.create(file=("x.jsonl", io.BytesIO(jsonl([{}] * 61))), purpose="batch")
    with pytest.raises(openai.APIStatusError) as too_big:
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n" * 30000)), purpose="batch")
    assert too_big.value.status_code == 413
    # a structurally bad file: the batch fails before any line runs, lines named
    lines = [request_line(i) for i in range(4)]
    lines[1]["url"] = "/v1/completions"
    lines[3]["custom_id"] = "req-0"
    f = client.files.create(file=("bad.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    assert batch.status == "failed" and batch.request_counts.total == 0
    errors = batch.errors.data
    assert [(e.line, e.code) for e in errors] == [(2, "mismatched_endpoint"),
                                                  (4, "duplicate_custom_id")]
    assert "line 4" in errors[1].message and batch.output_file_id is None
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings",
                              completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="1h")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions",
                              completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")


def test_tenants_see_only_their_own(server):
    a, b = server.client("sk-a"), server.client("sk-b")
    f = a.files.create(file=("t.jsonl", io.BytesIO(jsonl([request_line(0)]))), purpose="batch")
    batch = a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                             completion_window="24h")
    for call in (lambda: b.files.retrieve(f.id), lambda: b.files.content(f.id),
                 lambda: b.files.delete(f.id), lambda: b.batches.retrieve(batch.id),
                 lambda: b.batches.cancel(batch.id),
                 lambda: b.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert f.id not in [x.id for x in b.files.list()]
    assert batch.id not in [x.id for x in b.batches.list()]
    assert batch.id in [x.id for x in a.batches.list()]
    with pytest.raises(openai.PermissionDeniedError):  # a key without the batch tier
        server.client("sk-i").batches.create(input_file_id=f.id,
                                             endpoint="/v1/chat/completions",
                                             completion_window="24h")
    wait_final(a, batch.id)
    assert a.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        a.files.retrieve(f.id)


def test_cancel_in_each_state(server):
    client = server.client("sk-a")
    lines = [request_line(i, max_tokens=32, ignore_eos=True) for i in range(60)]
    f = client.files.create(file=("long.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    deadline = time.time() + 60
    while client.batches.retrieve(batch.id).request_counts.completed < 1:
        assert time.time() < deadline
        time.sleep(0.1)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = wait_final(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    counts = batch.request_counts
    assert counts.completed + counts.failed == counts.total == 60 and counts.completed >= 1
    out, err = read_lines(client, batch.output_file_id), read_lines(client, batch.error_file_id)
    ids = [x["custom_id"] for x in out + err]
    assert sorted(ids) == sorted(x["custom_id"] for x in lines)  # each line exactly once
    skipped = [x for x in err if x["error"] and x["error"]["code"] == "batch_cancelled"]
    assert len(skipped) == counts.failed > 0
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: no change
    with pytest.raises(openai.ConflictError):  # a completed batch cannot be cancelled
        small = client.files.create(file=("s.jsonl", io.BytesIO(jsonl([request_line(1)]))),
                                    purpose="batch")
        done = wait_final(client, client.batches.create(
            input_file_id=small.id, endpoint="/v1/chat/completions",
            completion_window="24h").id)
        assert done.status == "completed"
        client.batches.cancel(done.id)
    bad = client.files.create(file=("b.jsonl", io.BytesIO(b'{"custom_id": "x"}\n')),
                              purpose="batch")
    failed = client.batches.create(input_file_id=bad.id, endpoint="/v1/chat/completions",
                                   completion_window="24h")
    assert failed.status == "failed"
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(failed.id)


def test_priority_requests_jump_a_large_batch(server):
    """Batch lines fill every sequence slot; a priority request is still scheduled at once
    (it preempts a batch line, which later completes), not after the lines ahead of it."""
    client = server.client("sk-a")
    lines = [request_line(i, max_tokens=64, ignore_eos=True) for i in range(48)]
    f = client.files.create(file=("big.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    while len(server.engine.scheduler.running) < 16:
        time.sleep(0.05)
    before = dict(server.engine.scheduler.preemptions_by_tier)
    fast = client.chat.completions.create(
        model=MODEL, max_tokens=4, service_tier="priority",
        messages=[{"role": "user", "content": "Hi"}])
    queue_s = fast.usage.model_dump()["timing"]["queue_s"]
    assert fast.service_tier == "priority"
    after = client.batches.retrieve(batch.id)
    assert after.status == "in_progress"  # served while the batch was still running
    line_s = 64 * 0.01  # a batch line takes far longer than this; the request did not wait
    assert queue_s < line_s, queue_s
    preempted = {t: n - before.get(t, 0)
                 for t, n in server.engine.scheduler.preemptions_by_tier.items()}
    assert {t for t, n in preempted.items() if n} == {Tier.BATCH}
    batch = wait_final(client, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 48


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, root) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierserve.cli", "serve", "--port", str(port),
         "--served-model-name", MODEL, "--data-dir", str(root / "data"),
         "--ledger", str(root / "ledger.db"), "--max-num-seqs", "4",
         "--batch-max-in-flight", "4", "--priority-step-time-s", "0"],
        stdout=subprocess.DEVNULL, stderr=open(root / "server.log", "ab"))
    deadline = time.time() + 120
    while True:
        assert proc.poll() is None, (root / "server.log").read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, "server did not become ready"
        time.sleep(0.2)


def test_sigkill_mid_batch_then_restart_runs_every_line_exactly_once(tmp_path):
    port = free_port()
    proc = start_server(port, tmp_path)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0)
        lines = [request_line(i, max_tokens=12, ignore_eos=True) for i in range(30)]
        f = client.files.create(file=("k.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        deadline = time.time() + 120
        while client.batches.retrieve(batch.id).request_counts.completed < 6:
            assert time.time() < deadline
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        done_at_kill = sum(1 for _ in connect_lines(tmp_path, batch.id))
        assert 6 <= done_at_kill < 30  # killed mid-batch, lines in flight
        proc = start_server(port, tmp_path)
        batch = wait_final(client, batch.id)
        assert batch.status == "completed"
        assert (batch.request_counts.completed, batch.request_counts.total) == (30, 30)
        out = read_lines(client, batch.output_file_id)
        ids = [x["custom_id"] for x in out]
        assert len(ids) == 30 and set(ids) == {x["custom_id"] for x in lines}
        assert all(x["response"]["status_code"] == 200 for x in out)
        assert batch.error_file_id is None
    finally:
        proc.kill()
        proc.wait()


def connect_lines(root, batch_id):
    from tierserve.batch.store import MIGRATIONS
    db = connect(root / "data" / "batches.db", MIGRATIONS)
    return db.execute("SELECT idx FROM lines WHERE batch_id = ? AND state != 'pending'",
                      (batch_id,)).fetchall()


def test_batch_cli_submit_wait_status_results(server, tmp_path, capsys):
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([request_line(i, max_tokens=4) for i in range(5)]))
    base = ["--base-url", server.url + "/v1", "--api-key", "sk-b"]
    assert main(["batch", "submit", str(path), "--wait", "--poll-s", "0.2", *base]) == 0
    out = capsys.readouterr().out
    batch_id = out.splitlines()[0]
    assert batch_id.startswith("batch_") and "completed: 5 completed, 0 failed" in out
    assert main(["batch", "status", batch_id, "--format", "json", *base]) == 0
    assert json.loads(capsys.readouterr().out)["request_counts"]["completed"] == 5
    results = tmp_path / "out.jsonl"
    assert main(["batch", "results", batch_id, "-o", str(results), *base]) == 0
    assert len(results.read_text().splitlines()) == 5
    # errors: one line each, exit 1, nothing lost
    assert main(["batch", "status", "batch_nope", *base]) == 1
    assert "HTTP 404" in capsys.readouterr().err
    assert main(["batch", "submit", str(tmp_path / "missing.jsonl"), *base]) == 1
    assert "no such file" in capsys.readouterr().err
    assert main(["batch", "status", "x", "--base-url", f"http://127.0.0.1:{free_port()}/v1"]) == 1
    assert "cannot reach" in capsys.readouterr().err
