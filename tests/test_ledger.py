"""The ledger on SQLite and on PostgreSQL: migrations (in transactions, concurrent), concurrent
reading, durability, and spend seen across gateways (no model needed)."""

import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from pg import create_database, dialect, pg_database, pg_server  # noqa: F401 (fixtures)

from tierserve.db import open_database
from tierserve.metering.ledger import MIGRATIONS, Ledger, Migrations, RequestRow, connect


@pytest.fixture
def target(dialect, tmp_path, request):  # noqa: F811
    """Where a test's ledger lives: a SQLite file, or a fresh PostgreSQL database."""
    if dialect == "sqlite":
        return str(tmp_path / "l.db")
    return request.getfixturevalue("pg_database")


def row(i, tenant="t", tier="default", charge=3e-6, at=None):
    return RequestRow(time=1000.0 + i if at is None else at, request_id=f"r{i}", tenant=tenant,
                      model="m", tier_requested=tier, tier_served=tier, prompt_tokens=10,
                      cached_tokens=2, output_tokens=5, queue_s=0.01, prefill_s=0.02,
                      decode_s=0.1, prefill_cost=1e-6, decode_cost=2e-6, charge=charge,
                      finish_reason="stop", tags={"team": "x"}, mean_batch_size=3.0)


def applied(db) -> list[str]:
    return sorted(r[0] for r in db.execute("SELECT name FROM _migrations"))


def columns(db, table: str) -> list[str] | None:
    """The columns of `table`, or None if there is no such table."""
    if not db.table_exists(table):
        return None
    return [d[0] for d in db.execute(f"SELECT * FROM {table} LIMIT 0").description]


def test_rows_are_written_and_nothing_is_lost_on_a_clean_close(target):
    ledger = Ledger(target)
    for i in range(1000):
        ledger.record(row(i))
    ledger.record_idle(0.0, 60.0, "m", 0.01, 0.002)
    ledger.close()
    db = connect(target)
    assert db.execute("SELECT count(*), sum(output_tokens) FROM requests").fetchone() == (1000, 5000)
    tags, batch = db.execute("SELECT tags, mean_batch_size FROM requests LIMIT 1").fetchone()
    assert tags == '{"team": "x"}' and batch == 3.0
    assert db.execute("SELECT cost, reserved_cost FROM idle").fetchall() == [(0.01, 0.002)]
    assert db.execute('SELECT start, "end" FROM idle').fetchall() == [(0.0, 60.0)]
    # unix seconds and USD keep full precision (PostgreSQL's REAL would be 4 bytes)
    assert db.execute("SELECT time, charge FROM requests WHERE request_id = 'r999'"
                      ).fetchone() == (1999.0, 3e-6)
    if db.dialect == "sqlite":
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_migrations_from_empty_and_from_an_older_database(target, tmp_path, dialect):  # noqa: F811
    db = connect(target)
    assert applied(db) == sorted(fn.__name__ for fn in MIGRATIONS)
    db.close()
    # An older database: only the first migration, with a row in it.
    old = tmp_path / "old.db" if dialect == "sqlite" else create_database(target)
    db = connect(old, MIGRATIONS[:1])
    db.execute("INSERT INTO requests (time, request_id, tenant, model, tier_requested, "
               "tier_served, prompt_tokens, cached_tokens, output_tokens, prefill_cost, "
               "decode_cost, charge, finish_reason) VALUES "
               "(1, 'old', 't', 'm', 'default', 'default', 1, 0, 1, 0, 0, 0, 'stop')")
    assert applied(db) == ["m001_requests"]
    db.close()
    db = connect(old)
    assert db.execute("SELECT request_id, mean_batch_size FROM requests").fetchall() == \
        [("old", None)]
    assert db.execute("SELECT count(*) FROM _migrations").fetchone()[0] == len(MIGRATIONS)
    connect(old).close()  # applying again changes nothing
    assert db.execute("SELECT count(*) FROM _migrations").fetchone()[0] == len(MIGRATIONS)


def _two_steps(fail: bool) -> Migrations:
    steps = Migrations()

    @steps
    def m001_a(db):
        db.ddl("CREATE TABLE a (id INTEGER PRIMARY KEY, x TEXT NOT NULL)")

    @steps
    def m002_b(db):
        db.ddl("CREATE TABLE b (y REAL)")
        db.execute("INSERT INTO a (x) VALUES ('half')")
        db.ddl("ALTER TABLE a ADD COLUMN z REAL")
        if fail:
            raise RuntimeError("crash midway through m002_b")
    return steps


def test_a_migration_failing_midway_leaves_the_previous_version(target):
    connect(target, _two_steps(False)[:1]).close()
    with pytest.raises(RuntimeError, match="crash midway"):
        connect(target, _two_steps(True))
    db = open_database(target)  # reopenable, at version m001, nothing of m002 in it
    assert applied(db) == ["m001_a"]
    assert columns(db, "b") is None and columns(db, "a") == ["id", "x"]
    assert db.execute("SELECT count(*) FROM a").fetchone()[0] == 0
    db.close()
    db = connect(target, _two_steps(False))  # the fixed step applies cleanly
    assert applied(db) == ["m001_a", "m002_b"] and columns(db, "a") == ["id", "x", "z"]
    assert db.execute("SELECT x FROM a").fetchall() == [("half",)]


def test_a_process_killed_midway_through_a_migration_leaves_the_previous_version(target):
    code = textwrap.dedent(f"""
        import time
        from tierserve.db import connect
        from tierserve.metering.ledger import Migrations
        steps = Migrations()
        @steps
        def m001_a(db):
            db.ddl("CREATE TABLE a (id INTEGER PRIMARY KEY, x TEXT NOT NULL)")
        @steps
        def m002_b(db):
            db.ddl("CREATE TABLE b (y REAL)")
            db.execute("INSERT INTO a (x) VALUES ('half')")
            print("midway", flush=True)
            time.sleep(60)
        connect({target!r}, steps)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "midway"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    db = connect(target, _two_steps(False)[:1])  # not blocked by the dead one's lock
    assert applied(db) == ["m001_a"] and columns(db, "b") is None
    assert db.execute("SELECT count(*) FROM a").fetchone()[0] == 0
    if db.dialect == "sqlite":
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    db.close()
    assert applied(connect(target, _two_steps(False))) == ["m001_a", "m002_b"]


def test_gateways_starting_at_once_apply_each_migration_once(target):
    barrier, errors, dbs = threading.Barrier(4), [], []

    def start():
        barrier.wait()
        try:
            dbs.append(connect(target))
        except Exception as exc:  # pragma: no cover - the failure being tested for
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(dbs) == 4
    assert applied(dbs[0]) == sorted(fn.__name__ for fn in MIGRATIONS)
    for db in dbs:
        db.close()


def test_a_reader_reads_while_the_writer_writes(target):
    ledger = Ledger(target, commit_interval_s=0.01)
    reader = connect(target)
    seen = []
    for i in range(300):
        ledger.record(row(i))
        if i % 50 == 0:
            seen.append(reader.execute("SELECT count(*) FROM requests").fetchone()[0])
            time.sleep(0.02)
    ledger.close()
    assert seen == sorted(seen) and seen[-1] > 0
    assert reader.execute("SELECT count(*) FROM requests").fetchone()[0] == 300


def test_spent_sums_a_tenants_charges_since_a_time(target):
    ledger = Ledger(target, commit_interval_s=0.01)
    assert ledger.spent("a", 0) == 0.0
    for i in range(10):
        ledger.record(row(i, tenant="a", charge=0.5, at=100.0 + i))
    ledger.record(row(10, tenant="b", charge=7.0, at=105.0))
    ledger.close()
    assert ledger.spent("a", 0) == pytest.approx(5.0)
    assert ledger.spent("a", 105.0) == pytest.approx(2.5)  # times 105..109
    assert ledger.spent("b", 0) == pytest.approx(7.0) and ledger.spent("c", 0) == 0.0
    assert isinstance(ledger.spent("a", 0), float)


def test_two_gateways_see_each_others_spend(target):
    """Two Ledgers on one database (two gateways): each one's `spent` counts both's rows."""
    one, two = Ledger(target, commit_interval_s=0.01), Ledger(target, commit_interval_s=0.01)
    for i in range(20):
        one.record(row(i, tenant="acme", charge=0.25, at=time.time()))
        two.record(row(100 + i, tenant="acme", charge=0.5, at=time.time()))
    deadline = time.monotonic() + 10
    while one.spent("acme", 0) < 15.0 and time.monotonic() < deadline:
        time.sleep(0.02)  # both writers commit within their interval
    assert one.spent("acme", 0) == pytest.approx(15.0)
    assert two.spent("acme", 0) == pytest.approx(15.0)
    two.close()
    one.record(row(200, tenant="acme", charge=1.0))
    one.close()
    assert two.spent("acme", 0) == pytest.approx(16.0)  # a closed ledger still reads


def test_the_database_survives_sigkill_mid_run(target):
    code = textwrap.dedent(f"""
        import sys, time
        from tierserve.metering.ledger import Ledger, RequestRow
        ledger = Ledger({target!r}, commit_interval_s=0.05)
        i = 0
        print("ready", flush=True)
        while True:
            ledger.record(RequestRow(time.time(), f"r{{i}}", "t", "m", "default", "default",
                                     1, 0, 1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, "stop"))
            i += 1
            time.sleep(0.0005)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(1.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    db = connect(target)
    if db.dialect == "sqlite":
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    n, last = db.execute("SELECT count(*), max(time) FROM requests").fetchone()
    assert n > 100
    ids = [r[0] for r in db.execute("SELECT request_id FROM requests ORDER BY id")]
    assert ids == [f"r{i}" for i in range(n)]  # a prefix: nothing lost in the middle


def test_bill_reads_the_ledger(target):
    from tierserve.metering.bill import load, summarize
    ledger = Ledger(target)
    for i in range(4):
        ledger.record(row(i, tier="priority" if i % 2 else "default"))
    ledger.record_idle(1000.0, 1010.0, "m", 0.5, 0.25)
    ledger.record_idle(0.0, 10.0, "m", 9.0, 9.0)  # before the window: not in the bill
    ledger.close()
    rows, idle = load(target, 1001.0, None)
    assert [r["request_id"] for r in rows] == ["r1", "r2", "r3"]
    assert rows[0]["tags"] == {"team": "x"} and rows[0]["machine_cost"] == pytest.approx(3e-6)
    assert [(i["start"], i["end"]) for i in idle] == [(1000.0, 1010.0)]
    totals = summarize(rows, idle, "tier")["totals"]
    assert totals["requests"] == 3 and totals["idle_cost"] == 0.5


def test_the_ledger_reconnects_when_postgresql_drops_its_connections(pg_database):  # noqa: F811
    """A restarted PostgreSQL (here: every backend of the database terminated) costs no
    rows: the writer retries on a new connection, and `spent` reopens its own."""
    ledger = Ledger(pg_database, commit_interval_s=0.01)
    for i in range(10):
        ledger.record(row(i, charge=1.0))
    deadline = time.monotonic() + 10
    while ledger.spent("t", 0) < 10 and time.monotonic() < deadline:
        time.sleep(0.02)
    admin = open_database(pg_database)
    admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                  "datname = current_database() AND pid <> pg_backend_pid()")
    for i in range(10, 20):
        ledger.record(row(i, charge=1.0))
    ledger.close()
    assert ledger.spent("t", 0) == 20.0
    assert admin.execute("SELECT count(*) FROM requests").fetchone()[0] == 20
