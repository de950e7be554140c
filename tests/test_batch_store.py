"""The batch store and runner without a model: a fake `execute`, a controllable clock.
Exactly-once recording, line order, expiry, and resuming after the runner is stopped; each
on SQLite (batches.db in the data directory) and on PostgreSQL."""

import asyncio
import json
import threading

import pytest
from pg import dialect, pg_database, pg_server  # noqa: F401 (fixtures)

from tierserve.batch.runner import BatchRunner
from tierserve.batch.store import BatchStore
from tierserve.batch.validate import parse_requests


@pytest.fixture
def open_store(dialect, tmp_path, request):  # noqa: F811
    """Opens a store on the test's data directory: its metadata in SQLite there, or in a
    fresh PostgreSQL database (the same one on every call: a restart, another gateway)."""
    database = None if dialect == "sqlite" else request.getfixturevalue("pg_database")
    stores = []

    def open_():
        stores.append(BatchStore(tmp_path, database))
        return stores[-1]
    yield open_
    for store in stores:
        store.close()


def make_batch(store: BatchStore, n: int, window_s: int = 3600) -> str:
    requests = [(f"c{i}", {"model": "m", "prompt": f"p{i}"}) for i in range(n)]
    return store.create_batch("t", "file-x", "/v1/completions", window_s, "24h", None,
                              requests, [])["id"]


class FakeEngine:
    """Answers each line after `delay_s`, with a usage of len(prompt) tokens."""

    def __init__(self, delay_s: float = 0.01):
        self.delay_s = delay_s
        self.calls: list[str] = []

    async def __call__(self, batch, custom_id: str, body: dict, request_id: str):
        self.calls.append(custom_id)
        await asyncio.sleep(self.delay_s)
        if body.get("bad"):
            return 400, {"error": {"message": "bad line", "type": "invalid_request_error"}}
        return 200, {"id": request_id, "usage": {
            "prompt_tokens": 2, "completion_tokens": len(body["prompt"]),
            "cost": 1.0, "cost_details": {"machine_usd": 0.5, "charge_usd": 1.0}}}


async def run_until_idle(runner: BatchRunner, timeout_s: float = 10.0) -> None:
    task = asyncio.create_task(runner.run())
    await asyncio.sleep(0.05)
    await asyncio.wait_for(runner.idle.wait(), timeout_s)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_a_line_is_recorded_once(open_store):
    store = open_store()
    bid = make_batch(store, 2)
    assert store.record(bid, 0, True, {"custom_id": "c0"}, {"completion_tokens": 5})
    assert not store.record(bid, 0, False, {"custom_id": "c0"}, {"completion_tokens": 5})
    batch = store.get_batch("t", bid)
    assert batch["request_counts"] == {"total": 2, "completed": 1, "failed": 0}
    assert batch["usage"]["output_tokens"] == 5 and store.pending(bid) == [1]


def test_runner_completes_batches_in_line_order_with_totals(open_store):
    store = open_store()
    bid = make_batch(store, 12)
    engine = FakeEngine()
    asyncio.run(run_until_idle(BatchRunner(store, engine, max_in_flight=4)))
    batch = store.get_batch("t", bid)
    assert batch["status"] == "completed" and batch["completed_at"] is not None
    assert batch["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
    assert batch["usage"]["output_tokens"] == sum(len(f"p{i}") for i in range(12))
    assert batch["cost"]["charge_usd"] == pytest.approx(12.0)
    out = store.path(batch["output_file_id"]).read_text().splitlines()
    assert [json.loads(x)["custom_id"] for x in out] == [f"c{i}" for i in range(12)]
    assert batch["error_file_id"] is None and sorted(engine.calls) == sorted(
        f"c{i}" for i in range(12))


def test_expiry_keeps_running_lines_and_skips_the_rest(open_store):
    now = [1000.0]
    store = open_store()
    bid = make_batch(store, 20)
    store.db.execute("UPDATE batches SET expires_at = ?", (2000,))
    store.db.commit()

    async def main():
        engine = FakeEngine(delay_s=0.05)
        runner = BatchRunner(store, engine, max_in_flight=3, clock=lambda: now[0])
        task = asyncio.create_task(runner.run())
        while len(engine.calls) < 3:
            await asyncio.sleep(0.01)
        now[0] = 3000.0  # past expires_at with three lines in flight
        runner.wake()
        await asyncio.wait_for(runner.idle.wait(), 10)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return engine

    engine = asyncio.run(main())
    batch = store.get_batch("t", bid)
    counts = batch["request_counts"]
    assert batch["status"] == "expired" and batch["expired_at"] is not None
    assert counts["completed"] == len(engine.calls) >= 3
    assert counts["completed"] + counts["failed"] == counts["total"] == 20
    errors = [json.loads(x) for x in store.path(batch["error_file_id"]).read_text().splitlines()]
    assert all(e["error"]["code"] == "batch_expired" for e in errors)
    assert len(errors) == counts["failed"]


def test_a_stopped_runner_leaves_lines_pending_and_the_next_one_finishes_them(open_store):
    store = open_store()
    bid = make_batch(store, 10)

    async def first():
        engine = FakeEngine(delay_s=0.05)
        task = asyncio.create_task(BatchRunner(store, engine, max_in_flight=2).run())
        while store.get_batch("t", bid)["request_counts"]["completed"] < 3:
            await asyncio.sleep(0.01)
        task.cancel()  # a shutdown with two lines in flight
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(first())
    done_before = store.get_batch("t", bid)["request_counts"]["completed"]
    assert 3 <= done_before < 10 and len(store.pending(bid)) == 10 - done_before
    store.close()
    store = open_store()  # a restart: a new store on the same files and database
    asyncio.run(run_until_idle(BatchRunner(store, FakeEngine(), max_in_flight=2)))
    batch = store.get_batch("t", bid)
    out = [json.loads(x)["custom_id"]
           for x in store.path(batch["output_file_id"]).read_text().splitlines()]
    assert batch["status"] == "completed" and out == [f"c{i}" for i in range(10)]


def test_failed_lines_go_to_the_error_file(open_store):
    store = open_store()
    requests = [("a", {"prompt": "x"}), ("b", {"prompt": "y", "bad": True})]
    bid = store.create_batch("t", "file-x", "/v1/completions", 60, "24h", {"k": "v"},
                             requests, [])["id"]
    asyncio.run(run_until_idle(BatchRunner(store, FakeEngine(), max_in_flight=8)))
    batch = store.get_batch("t", bid)
    assert batch["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    err = json.loads(store.path(batch["error_file_id"]).read_text())
    assert err["custom_id"] == "b" and err["response"]["status_code"] == 400


def test_a_line_recorded_by_two_gateways_at_once_counts_once(open_store):
    """Two stores on one database (two gateways) race to record every line: each line is
    recorded by exactly one of them, and the batch's totals count it once."""
    first, second = open_store(), open_store()
    bid = make_batch(first, 40)
    wins = {first: [], second: []}
    barrier = threading.Barrier(2)

    def record_all(store):
        barrier.wait()
        for idx in range(40):
            if store.record(bid, idx, True, {"custom_id": f"c{idx}"},
                            {"prompt_tokens": 1, "completion_tokens": 2,
                             "cost": 0.5,
                             "cost_details": {"machine_usd": 0.25, "charge_usd": 0.5}}):
                wins[store].append(idx)

    threads = [threading.Thread(target=record_all, args=(s,)) for s in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(wins[first] + wins[second]) == list(range(40))
    for store in (first, second):
        batch = store.get_batch("t", bid)
        assert batch["request_counts"] == {"total": 40, "completed": 40, "failed": 0}
        assert batch["usage"]["output_tokens"] == 80
        assert batch["cost"]["charge_usd"] == pytest.approx(20.0)
        assert store.pending(bid) == []


def test_rows_read_by_name_and_by_position(open_store):
    store = open_store()
    bid = make_batch(store, 1)
    row = store.batch_row(bid, "t")
    assert row["id"] == row[0] == bid and row["tenant"] == "t" and "status" in row.keys()
    [active] = store.active()
    assert active["id"] == bid and active["expires_at"] == active["created_at"] + 3600
    with pytest.raises(Exception):
        store.batch_row(bid, "another tenant")


def test_validation_names_lines(tmp_path):
    path = tmp_path / "in.jsonl"
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}},
             {"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}},
             "not an object"]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n{broken\n")
    requests, errors = parse_requests(path, "/v1/completions", 100)
    assert requests == []
    assert [(e["line"], e["code"]) for e in errors] == [
        (2, "duplicate_custom_id"), (2, "invalid_method"), (3, "invalid_request"),
        (5, "invalid_json_line")]
