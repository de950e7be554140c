"""The ledger: one row per finished request (success, error or abort), and the idle
intervals between steps, so a bill can be explained line by line. It lives in a SQLite file
(the default) or in PostgreSQL (`postgresql://...`), which several gateways share.

NOTE: durability
    Rows go through a queue to one writer thread, which commits every
    `commit_interval_s` (0.25 s): the engine loop never waits on the database. `close()`
    drains the queue and commits, so a clean shutdown loses nothing. `barrier(callback)`
    commits what is queued at once and then calls back: the server answers a request (and
    the batch runner marks a line done) only after its row is committed, so whatever a
    client was told finished is in the ledger even after a SIGKILL. A SQLite ledger is in
    WAL mode: after a SIGKILL at most the rows of the last commit interval are missing,
    and it opens cleanly. Readers (`tierserve bill`, `spent`) can read while the server
    writes. If a commit fails (PostgreSQL restarting, a network error), the writer logs it,
    reconnects and retries the same rows with backoff; only `close()` while the database
    stays unreachable gives up, and logs how many rows it dropped.

NOTE: migrations
    The schema is an append-only list of `@migration` functions, applied in order, each in
    one transaction with its row in `_migrations` (see tierserve.db). Never edit one that
    has shipped: add the next. Opening an older database brings it up to date; an empty
    one gets them all. Write schema statements with `db.ddl` (SQLite's types, mapped on
    PostgreSQL), and quote the column `end` (reserved in PostgreSQL) in every query.

NOTE: one row per request id
    `request_id` is unique, and writing a row for an id already there replaces it. A batch
    line runs under an id made from its batch and line, so a line that finished just
    before a crash and runs again after the restart is charged once (for the run whose
    answer the output file holds), not twice.
"""

import itertools
import json
import logging
import os
import queue
import threading
import time
from dataclasses import asdict, dataclass, field
from operator import itemgetter
from pathlib import Path

from tierserve import db as database
from tierserve.db import Database, Migrations, is_postgres, open_database

log = logging.getLogger("tierserve.ledger")


MIGRATIONS = migration = Migrations()


@migration
def m001_requests(db: Database) -> None:
    db.ddl("""
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
def m002_idle(db: Database) -> None:
    db.ddl("""
        CREATE TABLE idle (
            id INTEGER PRIMARY KEY,
            start REAL NOT NULL,           -- unix seconds
            "end" REAL NOT NULL,           -- quoted: reserved in PostgreSQL
            model TEXT NOT NULL,
            cost REAL NOT NULL,            -- unreserved idle machine cost, USD
            reserved_cost REAL NOT NULL    -- idle cost of capacity held for priority
        )""")


@migration
def m003_batch_and_latency(db: Database) -> None:
    db.ddl("ALTER TABLE requests ADD COLUMN mean_batch_size REAL")
    db.ddl("ALTER TABLE requests ADD COLUMN ttft_s REAL")
    db.ddl("ALTER TABLE requests ADD COLUMN e2e_s REAL")
    db.ddl("CREATE INDEX requests_time ON requests (time)")
    db.ddl("CREATE INDEX requests_tenant_time ON requests (tenant, time)")


@migration
def m004_unique_request_id(db: Database) -> None:
    # The unique index cannot be built over duplicate ids; none are expected (ids were
    # random before this step), but an edited ledger may have some: keep each id's latest.
    db.execute("DELETE FROM requests WHERE id NOT IN "
               "(SELECT max(id) FROM requests GROUP BY request_id)")
    db.ddl("CREATE UNIQUE INDEX requests_request_id ON requests (request_id)")


@migration
def m005_tenants_and_keys(db: Database) -> None:
    # Tenants and keys made through the admin API (server/tenants.py); keys stored hashed.
    db.ddl("""
        CREATE TABLE tenants (
            name TEXT PRIMARY KEY,
            spec TEXT NOT NULL,            -- JSON: tiers, weight, cache_group, budget, limits
            updated REAL NOT NULL
        )""")
    db.ddl("""
        CREATE TABLE api_keys (
            key_id TEXT PRIMARY KEY,
            key_hash TEXT NOT NULL UNIQUE, -- sha256 of the key, hex
            tenant TEXT NOT NULL,
            created REAL NOT NULL,
            revoked REAL                   -- unix seconds; NULL while the key works
        )""")


@migration
def m006_shared_holds_and_buckets(db: Database) -> None:
    # Budget holds and rate-limit buckets shared by the gateways of one database
    # (metering/shared.py; unused with SQLite, where one process keeps them in memory).
    from tierserve.metering.shared import migrate_shared
    migrate_shared(db)


def connect(path: str | Path, migrations: list | None = None) -> Database:
    """Open (creating if needed) and migrate the ledger at `path`, a SQLite file or a
    `postgresql://` URL (or another database with its own list of `migrations`, such as
    the batch store). The connection autocommits; `with db:` is a transaction."""
    return database.connect(path, MIGRATIONS if migrations is None else migrations)


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
                   f"({', '.join('?' * len(_REQUEST_COLUMNS))}) ON CONFLICT (request_id) "
                   f"DO UPDATE SET " + ", ".join(f"{c} = excluded.{c}" for c in
                                                  _REQUEST_COLUMNS if c != "request_id"))
_BARRIER = object()  # a queue item: commit now, then call back
_INSERT_IDLE = ('INSERT INTO idle (start, "end", model, cost, reserved_cost) '
                'VALUES (?, ?, ?, ?, ?)')
_SPENT = "SELECT coalesce(sum(charge), 0) FROM requests WHERE tenant = ? AND time >= ?"
_SETTLE_HOLD = "DELETE FROM holds WHERE request_id = ?"


class Ledger:
    """Asynchronous writer of ledger rows (see the module's note on durability).

    `path` is a SQLite file (kept as a Path) or a `postgresql://` URL (kept as the str)."""

    def __init__(self, path: str | Path, commit_interval_s: float = 0.25):
        self.path = path if is_postgres(path) else Path(path)
        self.commit_interval_s = commit_interval_s
        connect(self.path).close()  # create and migrate now: errors surface at startup
        self._queue: queue.Queue = queue.Queue()
        self._closing = False
        self._reader: Database | None = None
        self._reader_lock = threading.Lock()
        self._thread = threading.Thread(target=self._write_loop, name="ledger", daemon=True)
        self._thread.start()

    @property
    def dialect(self) -> str:
        return "postgresql" if is_postgres(self.path) else "sqlite"

    def record(self, row: RequestRow, settles_hold: bool = False) -> None:
        """Queue a request's row; `settles_hold`: also delete its shared budget hold
        (metering/shared.py), queued right after the row, so the two commit together
        (or, split across two commits, the hold outlives the row by one commit: counted
        twice for a moment, never neither)."""
        values = asdict(row)
        values["tags"] = json.dumps(row.tags, sort_keys=True)
        self._queue.put((_INSERT_REQUEST, tuple(values[c] for c in _REQUEST_COLUMNS)))
        if settles_hold:
            self._queue.put((_SETTLE_HOLD, (row.request_id,)))

    def barrier(self, callback) -> None:
        """Commit everything queued now, then call `callback()` (from the writer thread;
        also if the rows had to be dropped at close)."""
        self._queue.put((_BARRIER, callback))

    def record_idle(self, start_unix: float, end_unix: float, model: str, cost: float,
                    reserved_cost: float) -> None:
        self._queue.put((_INSERT_IDLE, (start_unix, end_unix, model, cost, reserved_cost)))

    def spent(self, tenant: str, since_unix: float) -> float:
        """What `tenant` was charged since `since_unix`, summed in the database: the rows
        committed by every gateway writing to it (not this one's rows still queued, at most
        one commit interval's). Thread-safe; uses its own connection, reopened if broken."""
        with self._reader_lock:
            for attempt in range(2):
                fresh = self._reader is None
                if fresh:
                    self._reader = open_database(self.path)
                try:
                    return float(self._reader.execute(_SPENT, (tenant, since_unix))
                                 .fetchone()[0])
                except Exception:
                    self._close_reader()
                    if fresh or attempt:
                        raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Write everything queued, then stop the writer (idempotent)."""
        self._closing = True
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        with self._reader_lock:
            self._close_reader()

    def _where(self) -> str:
        return database.redact(self.path) if is_postgres(self.path) else str(self.path)

    def _close_reader(self) -> None:
        if self._reader is not None:
            try:
                self._reader.close()
            except Exception:
                pass
            self._reader = None

    def _write_loop(self) -> None:
        db = None
        try:
            while True:
                batch, stop, callbacks = [], False, []
                item = self._queue.get()
                deadline = time.monotonic() + self.commit_interval_s
                while True:
                    if item is None:
                        stop = True
                        break
                    if item[0] is _BARRIER:
                        callbacks.append(item[1])
                        if not self._queue.empty():  # take what is already queued too
                            item = self._queue.get()
                            continue
                        break
                    batch.append(item)
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    try:
                        item = self._queue.get(timeout=remaining)
                    except queue.Empty:
                        break
                failures = 0
                while batch:
                    try:
                        if db is None:
                            db = open_database(self.path)
                        with db:
                            for sql, group in itertools.groupby(batch, key=itemgetter(0)):
                                db.executemany(sql, [values for _, values in group])
                        batch = []
                    except Exception:
                        failures += 1
                        log.exception("ledger: writing %d rows to %s failed (attempt %d)",
                                      len(batch), self._where(), failures)
                        if db is not None:
                            try:
                                db.close()
                            except Exception:
                                pass
                            db = None
                        if self._closing and failures >= 3:
                            log.error("ledger: closing; dropped %d rows", len(batch))
                            break
                        time.sleep(min(0.1 * 2 ** failures, 5.0))
                for callback in callbacks:
                    callback()
                if stop:
                    return
        finally:
            if db is not None:
                db.close()
