"""The ledger: one SQLite row per finished request (success, error or abort), and the
idle intervals between steps, so a bill can be explained line by line.

NOTE: durability
    Rows go through a queue to one writer thread, which commits every
    `commit_interval_s` (0.25 s): the engine loop never waits on the disk. `close()`
    drains the queue and commits, so a clean shutdown loses nothing. The database is in
    WAL mode: after a SIGKILL at most the rows of the last commit interval are missing,
    and it opens cleanly. Readers (`tierserve bill`) can read while the server writes.

NOTE: migrations
    The schema is an append-only list of `@migration` functions, applied in order; each
    applied one is recorded in `_migrations`. Never edit one that has shipped: add the
    next. Opening an older database brings it up to date; an empty file gets them all.
"""

import json
import os
import queue
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

class Migrations(list):
    """An append-only list of schema steps; calling it on a function (as a decorator)
    appends that function. Each database has its own (the batch store has another)."""

    def __call__(self, fn):
        self.append(fn)
        return fn


MIGRATIONS = migration = Migrations()


@migration
def m001_requests(db: sqlite3.Connection) -> None:
    db.execute("""
        CREATE TABLE requests (
            id INTEGER PRIMARY KEY,
            time REAL NOT NULL,            -- finish, unix seconds
            request_id TEXT NOT NULL,
            tenant TEXT NOT NULL,
            model TEXT NOT NULL,
            tier_requested TEXT NOT NULL,
            tier_served TEXT NOT NULL,
            prompt_tokens INTEGER NOT NULL,
            cached_tokens INTEGER NOT NULL,
            output_tokens INTEGER NOT NULL,
            queue_s REAL,
            prefill_s REAL,
            decode_s REAL,
            prefill_cost REAL NOT NULL,    -- machine cost, USD
            decode_cost REAL NOT NULL,
            charge REAL NOT NULL,          -- what the tenant is charged, USD
            finish_reason TEXT NOT NULL,   -- stop, length, abort, refused, error
            tags TEXT NOT NULL DEFAULT '{}'
        )""")


@migration
def m002_idle(db: sqlite3.Connection) -> None:
    db.execute("""
        CREATE TABLE idle (
            id INTEGER PRIMARY KEY,
            start REAL NOT NULL,           -- unix seconds
            end REAL NOT NULL,
            model TEXT NOT NULL,
            cost REAL NOT NULL,            -- unreserved idle machine cost, USD
            reserved_cost REAL NOT NULL    -- idle cost of capacity held for priority
        )""")


@migration
def m003_batch_and_latency(db: sqlite3.Connection) -> None:
    db.execute("ALTER TABLE requests ADD COLUMN mean_batch_size REAL")
    db.execute("ALTER TABLE requests ADD COLUMN ttft_s REAL")
    db.execute("ALTER TABLE requests ADD COLUMN e2e_s REAL")
    db.execute("CREATE INDEX requests_time ON requests (time)")
    db.execute("CREATE INDEX requests_tenant_time ON requests (tenant, time)")


def connect(path: str | Path, migrations: list | None = None) -> sqlite3.Connection:
    """Open (creating if needed) and migrate the ledger at `path` (or another database
    with its own list of `migrations`, such as the batch store)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, timeout=30, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("CREATE TABLE IF NOT EXISTS _migrations (name TEXT PRIMARY KEY, "
               "applied_at REAL NOT NULL)")
    applied = {row[0] for row in db.execute("SELECT name FROM _migrations")}
    for fn in MIGRATIONS if migrations is None else migrations:
        if fn.__name__ not in applied:
            with db:
                fn(db)
                db.execute("INSERT INTO _migrations VALUES (?, ?)", (fn.__name__, time.time()))
    return db


def default_path() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(Path.home(), ".local", "share")
    return Path(base) / "tierserve" / "ledger.db"


@dataclass
class RequestRow:
    time: float
    request_id: str
    tenant: str
    model: str
    tier_requested: str
    tier_served: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    queue_s: float | None
    prefill_s: float | None
    decode_s: float | None
    prefill_cost: float
    decode_cost: float
    charge: float
    finish_reason: str
    tags: dict = field(default_factory=dict)
    mean_batch_size: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None


_REQUEST_COLUMNS = list(RequestRow.__dataclass_fields__)
_INSERT_REQUEST = (f"INSERT INTO requests ({', '.join(_REQUEST_COLUMNS)}) VALUES "
                   f"({', '.join('?' * len(_REQUEST_COLUMNS))})")
_INSERT_IDLE = "INSERT INTO idle (start, end, model, cost, reserved_cost) VALUES (?, ?, ?, ?, ?)"


class Ledger:
    """Asynchronous writer of ledger rows (see the module's note on durability)."""

    def __init__(self, path: str | Path, commit_interval_s: float = 0.25):
        self.path = Path(path)
        self.commit_interval_s = commit_interval_s
        connect(self.path).close()  # create and migrate now: errors surface at startup
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._write_loop, name="ledger", daemon=True)
        self._thread.start()

    def record(self, row: RequestRow) -> None:
        values = asdict(row)
        values["tags"] = json.dumps(row.tags, sort_keys=True)
        self._queue.put((_INSERT_REQUEST, tuple(values[c] for c in _REQUEST_COLUMNS)))

    def record_idle(self, start_unix: float, end_unix: float, model: str, cost: float,
                    reserved_cost: float) -> None:
        self._queue.put((_INSERT_IDLE, (start_unix, end_unix, model, cost, reserved_cost)))

    def close(self) -> None:
        """Write everything queued, then stop the writer (idempotent)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _write_loop(self) -> None:
        db = connect(self.path)
        try:
            while True:
                batch, stop = [], False
                item = self._queue.get()
                deadline = time.monotonic() + self.commit_interval_s
                while True:
                    if item is None:
                        stop = True
                        break
                    batch.append(item)
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    try:
                        item = self._queue.get(timeout=remaining)
                    except queue.Empty:
                        break
                with db:
                    for sql, values in batch:
                        db.execute(sql, values)
                if stop:
                    return
        finally:
            db.close()
