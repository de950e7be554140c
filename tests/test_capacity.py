"""A capacity schedule followed live (issue 19): a compressed day (seconds for hours) on
the real engine through real HTTP; the engine's reserves and caps change at each entry,
batch lines wait for the batch entry, the autoscaler's figures follow, no request is lost."""

import io
import threading
import time

import httpx
import pytest

from conftest import get_engine
from test_batch import jsonl, request_line
from test_server import MODEL, LiveServer
from tierserve.engine.async_engine import AsyncEngine
from tierserve.errors import ConfigError
from tierserve.server.settings import ServerSettings
from tierserve.schedule import HourPlan, Schedule, parse_schedule

HOUR_S = 3.0
ENTRIES = [  # (max_num_seqs, reserved, step cap, batch, replicas)
    (8, 2, None, False, 3),
    (4, 1, None, True, 1),
    (6, 0, 0.25, False, 2),
]


def schedule(start: float) -> Schedule:
    return Schedule(start, [HourPlan({"main": r}, {"main": r}, seqs, 1024, res, cap, batch)
                            for seqs, res, cap, batch, r in ENTRIES], hour_s=HOUR_S)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("capacity")
    # The engine first: loading the model takes seconds when this file runs alone, and
    # entry 0 (3 s) must still be live once the server answers.
    engine = AsyncEngine(get_engine(max_num_seqs=10))
    started_cap = engine.engine.scheduler.step_time_limit_s  # before any entry applies
    start = time.time() + 2.0  # entry 0 starts once the server is up
    srv = LiveServer(ServerSettings(schedule=schedule(start), data_dir=str(root / "d"),
                                    ledger=str(root / "l.db")), async_engine=engine)
    srv.start, srv.started_cap = start, started_cap
    yield srv
    srv.stop()


def test_the_engine_follows_the_schedule_and_no_request_is_lost(server):
    sched = server.engine.scheduler
    started_cap = server.started_cap
    statuses, stop = [], threading.Event()

    def load():
        while not stop.is_set():
            tier = ("priority", "default")[len(statuses) % 2]
            r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL, "max_tokens": 6, "service_tier": tier,
                "messages": [{"role": "user", "content": "Count to five."}]})
            statuses.append(r.status_code)

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    seen = {}
    try:
        deadline = server.start + 2 * HOUR_S * len(ENTRIES) + 0.5
        while time.time() < deadline:
            s = httpx.get(server.url + "/v1/schedule").json()
            seen.setdefault(s["entry"], set()).add(
                (s["applied"]["max_num_seqs"], s["applied"]["reserved_priority_seqs"],
                 s["applied"]["priority_step_time_s"], s["replicas"]["main"],
                 s["batch_open"], sched.config.max_num_seqs))
            time.sleep(0.25)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    for i, (seqs, res, cap, batch, replicas) in enumerate(ENTRIES):
        want = (seqs, res, started_cap if cap is None else cap, replicas, batch, seqs)
        assert want in seen[i], (i, seen[i])
    assert statuses and all(s == 200 for s in statuses), statuses
    text = httpx.get(server.url + "/metrics").text
    assert "tierserve_schedule_replicas{pool=" in text


def test_batch_lines_wait_for_the_batch_entry(server):
    client = server.client()
    now = time.time()
    # the next entry without batch work: submit at its start
    while schedule(server.start).entry_at(now).batch or \
            schedule(server.start).next_change(now) - now < HOUR_S - 0.5:
        time.sleep(0.1)
        now = time.time()
    f = client.files.create(file=("b.jsonl", io.BytesIO(jsonl([request_line(i, 4)
                                                                for i in range(3)]))),
                            purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    opens = schedule(server.start).next_batch_start(time.time())
    while time.time() < opens - 0.3:
        assert client.batches.retrieve(batch.id).request_counts.completed == 0
        time.sleep(0.2)
    deadline = time.time() + 60
    while client.batches.retrieve(batch.id).status != "completed":
        assert time.time() < deadline
        time.sleep(0.2)


def test_a_bad_schedule_is_refused_with_a_message():
    with pytest.raises(ConfigError, match="reserved_priority_seqs"):
        parse_schedule({"schedule": {"start": 0, "hours": [
            {"replicas": {"main": 1}, "need": {"main": 1}, "max_num_seqs": 2,
             "reserved_priority_seqs": 2}]}})
