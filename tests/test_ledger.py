"""The SQLite ledger: migrations, concurrent reading, durability (no model needed)."""

import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

from tierserve.metering.ledger import MIGRATIONS, Ledger, RequestRow, connect


def row(i, tenant="t", tier="default"):
    return RequestRow(time=1000.0 + i, request_id=f"r{i}", tenant=tenant, model="m",
                      tier_requested=tier, tier_served=tier, prompt_tokens=10,
                      cached_tokens=2, output_tokens=5, queue_s=0.01, prefill_s=0.02,
                      decode_s=0.1, prefill_cost=1e-6, decode_cost=2e-6, charge=3e-6,
                      finish_reason="stop", tags={"team": "x"}, mean_batch_size=3.0)


def test_rows_are_written_and_nothing_is_lost_on_a_clean_close(tmp_path):
    ledger = Ledger(tmp_path / "l.db")
    for i in range(1000):
        ledger.record(row(i))
    ledger.record_idle(0.0, 60.0, "m", 0.01, 0.002)
    ledger.close()
    db = connect(tmp_path / "l.db")
    assert db.execute("SELECT count(*), sum(output_tokens) FROM requests").fetchone() == (1000, 5000)
    tags, batch = db.execute("SELECT tags, mean_batch_size FROM requests LIMIT 1").fetchone()
    assert tags == '{"team": "x"}' and batch == 3.0
    assert db.execute("SELECT cost, reserved_cost FROM idle").fetchall() == [(0.01, 0.002)]
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_migrations_from_empty_and_from_an_older_database(tmp_path):
    db = connect(tmp_path / "new.db")
    names = [r[0] for r in db.execute("SELECT name FROM _migrations ORDER BY applied_at, name")]
    assert sorted(names) == sorted(fn.__name__ for fn in MIGRATIONS)
    # An older database: only the first migration, with a row in it.
    old = sqlite3.connect(tmp_path / "old.db")
    old.execute("CREATE TABLE _migrations (name TEXT PRIMARY KEY, applied_at REAL NOT NULL)")
    MIGRATIONS[0](old)
    old.execute("INSERT INTO _migrations VALUES ('m001_requests', 0)")
    old.execute("INSERT INTO requests (time, request_id, tenant, model, tier_requested, "
                "tier_served, prompt_tokens, cached_tokens, output_tokens, prefill_cost, "
                "decode_cost, charge, finish_reason) VALUES "
                "(1, 'old', 't', 'm', 'default', 'default', 1, 0, 1, 0, 0, 0, 'stop')")
    old.commit()
    old.close()
    db = connect(tmp_path / "old.db")
    assert db.execute("SELECT request_id, mean_batch_size FROM requests").fetchall() == \
        [("old", None)]
    assert db.execute("SELECT count(*) FROM _migrations").fetchone()[0] == len(MIGRATIONS)
    connect(tmp_path / "old.db")  # applying again changes nothing


def test_a_reader_reads_while_the_writer_writes(tmp_path):
    ledger = Ledger(tmp_path / "l.db", commit_interval_s=0.01)
    reader = connect(tmp_path / "l.db")
    seen = []
    for i in range(300):
        ledger.record(row(i))
        if i % 50 == 0:
            seen.append(reader.execute("SELECT count(*) FROM requests").fetchone()[0])
            time.sleep(0.02)
    ledger.close()
    assert seen == sorted(seen) and seen[-1] > 0
    assert reader.execute("SELECT count(*) FROM requests").fetchone()[0] == 300


def test_the_database_survives_sigkill_mid_run(tmp_path):
    path = tmp_path / "l.db"
    code = textwrap.dedent(f"""
        import sys, time
        from tierserve.metering.ledger import Ledger, RequestRow
        ledger = Ledger({str(path)!r}, commit_interval_s=0.05)
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
    db = connect(path)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    n, last = db.execute("SELECT count(*), max(time) FROM requests").fetchone()
    assert n > 100
    ids = [r[0] for r in db.execute("SELECT request_id FROM requests ORDER BY id")]
    assert ids == [f"r{i}" for i in range(n)]  # a prefix: nothing lost in the middle
