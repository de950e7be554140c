"""The batch store: uploaded files on disk, and in a database their metadata, the batch jobs
and the state and result of every line of every job. The database is `batches.db` (SQLite)
in the data directory, or PostgreSQL when `database` is a `postgresql://` URL (the files
stay in the data directory: gateways sharing one PostgreSQL need a shared data directory).

NOTE: exactly once
    Creating a batch copies its validated lines into `lines` (state `pending`) in the
    transaction that creates it. A line's result is written by `record`, an UPDATE guarded
    by `state = 'pending'`, in one transaction with the batch's counts: a line is recorded
    at most once. The runner feeds only pending lines; after a crash every line whose result
    was not committed is pending again and runs again. The output and error files are built
    from `lines` in line order once no line is in flight: each line appears exactly once,
    in one of the two. A file is written under a temporary name, fsynced and renamed, and
    recorded in the transaction that marks the batch final; a crash in between leaves the
    batch `finalizing`, and the next start writes its files again.

    On PostgreSQL the guarded UPDATE holds too: a second writer of the same line waits for
    the first one's row lock, then finds the line no longer pending and records nothing.
    Several gateways' runners share the lines by claiming them (`claim`): a line is one
    runner's while its lease runs, and anyone's once it has run out (its runner died),
    so a line runs on one gateway at a time and is recorded once whichever ran it.

All methods run on the server's event-loop thread; each call is a short transaction. Rows
are `tierserve.db.Row`: tuples that also read a column by name, on both databases.
"""

import json
import os
import time
import uuid
from pathlib import Path

from tierserve.db import Database, Migrations, Row, connect
from tierserve.errors import NotFoundError

MIGRATIONS = migration = Migrations()
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
FINAL = ("completed", "failed", "expired", "cancelled")


@migration
def m001_files_batches_lines(db: Database) -> None:
    db.ddl("""
        CREATE TABLE files (
            id TEXT PRIMARY KEY,
            tenant TEXT NOT NULL,
            filename TEXT NOT NULL,
            purpose TEXT NOT NULL,         -- batch (uploaded), batch_output (written by us)
            bytes INTEGER NOT NULL,
            created_at INTEGER NOT NULL
        )""")
    db.ddl("""
        CREATE TABLE batches (
            id TEXT PRIMARY KEY,
            tenant TEXT NOT NULL,
            endpoint TEXT NOT NULL,
            input_file_id TEXT NOT NULL,
            completion_window TEXT NOT NULL,
            status TEXT NOT NULL,
            created_at INTEGER NOT NULL,
            expires_at INTEGER NOT NULL,
            in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER,
            failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
            output_file_id TEXT, error_file_id TEXT,
            errors TEXT,                   -- JSON list of validation errors, or NULL
            metadata TEXT,                 -- JSON object, or NULL
            total INTEGER NOT NULL DEFAULT 0,
            completed INTEGER NOT NULL DEFAULT 0,
            failed INTEGER NOT NULL DEFAULT 0,
            prompt_tokens INTEGER NOT NULL DEFAULT 0,
            cached_tokens INTEGER NOT NULL DEFAULT 0,
            output_tokens INTEGER NOT NULL DEFAULT 0,
            machine_usd REAL NOT NULL DEFAULT 0,
            charge_usd REAL NOT NULL DEFAULT 0
        )""")
    db.ddl("""
        CREATE TABLE lines (
            batch_id TEXT NOT NULL,
            idx INTEGER NOT NULL,          -- 0-based position among the file's requests
            custom_id TEXT NOT NULL,
            body TEXT NOT NULL,            -- the request body, JSON
            state TEXT NOT NULL,           -- pending, done (output file), failed (error file)
            result TEXT,                   -- the output or error line, JSON
            PRIMARY KEY (batch_id, idx)
        )""")
    db.ddl("CREATE INDEX batches_tenant ON batches (tenant, created_at)")
    db.ddl("CREATE INDEX files_tenant ON files (tenant, created_at)")


@migration
def m002_line_leases(db: Database) -> None:
    # Lines are claimed by one runner at a time (gateways sharing one database), with a
    # lease its runner renews; a line whose lease ran out is anyone's again.
    db.ddl("ALTER TABLE lines ADD COLUMN claimed_by TEXT")
    db.ddl("ALTER TABLE lines ADD COLUMN lease_until REAL")


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


class BatchStore:
    def __init__(self, data_dir: str | Path, database: str | None = None):
        """Files under `data_dir`; metadata in `data_dir/batches.db`, or in `database` (a
        `postgresql://` URL, or another SQLite path) when given."""
        self.dir = Path(data_dir)
        self.files_dir = self.dir / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.db = connect(database or self.dir / "batches.db", MIGRATIONS)
        self.db.row_factory = Row

    def close(self) -> None:
        self.db.close()

    # ---------------------------------------------------------------- files
    def path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def add_file(self, tenant: str, filename: str, purpose: str, size: int,
                 file_id: str | None = None) -> dict:
        """Record a file already written at `path(file_id)`."""
        file_id = file_id or new_id("file-")
        with self.db:
            self.db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)",
                            (file_id, tenant, filename, purpose, size, int(time.time())))
        return self.get_file(tenant, file_id)

    def get_file(self, tenant: str, file_id: str) -> dict:
        row = self.db.execute("SELECT * FROM files WHERE id = ? AND tenant = ?",
                              (file_id, tenant)).fetchone()
        if row is None:  # another tenant's file is as absent as a missing one
            raise NotFoundError(f"no file with id {file_id!r}", param="file_id")
        return file_object(row)

    def list_files(self, tenant: str, purpose: str | None, after: str | None, limit: int,
                   order: str) -> tuple[list[dict], bool]:
        rows = self._page("files", tenant, after, limit, order,
                          "AND purpose = ?" if purpose else "", (purpose,) if purpose else ())
        return [file_object(r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, tenant: str, file_id: str) -> None:
        self.get_file(tenant, file_id)
        with self.db:
            self.db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        self.path(file_id).unlink(missing_ok=True)

    def write_file(self, tenant: str, filename: str, lines: list[str]) -> str | None:
        """Write an output file durably and record it; None for no lines."""
        if not lines:
            return None
        file_id = new_id("file-")
        tmp = self.path(file_id + ".tmp")
        with open(tmp, "w") as f:
            f.writelines(line + "\n" for line in lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path(file_id))
        self.add_file(tenant, filename, "batch_output", self.path(file_id).stat().st_size,
                      file_id)
        return file_id

    # -------------------------------------------------------------- batches
    def create_batch(self, tenant: str, input_file_id: str, endpoint: str, window_s: int,
                     window: str, metadata: dict | None, requests: list[tuple[str, dict]],
                     errors: list[dict]) -> dict:
        """A batch in_progress with its `requests` (custom_id, body) pending, or, with
        validation `errors`, failed before any line ran."""
        batch_id, now = new_id("batch_"), int(time.time())
        status = "failed" if errors else "in_progress"
        with self.db:
            self.db.execute(
                "INSERT INTO batches (id, tenant, endpoint, input_file_id, completion_window, "
                "status, created_at, expires_at, in_progress_at, failed_at, errors, metadata, "
                "total) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (batch_id, tenant, endpoint, input_file_id, window, status, now,
                 now + window_s, None if errors else now, now if errors else None,
                 json.dumps(errors) if errors else None,
                 json.dumps(metadata) if metadata is not None else None,
                 0 if errors else len(requests)))
            self.db.executemany(
                "INSERT INTO lines (batch_id, idx, custom_id, body, state, result) VALUES "
                "(?, ?, ?, ?, 'pending', NULL)",
                ((batch_id, i, cid, json.dumps(body)) for i, (cid, body) in enumerate(requests)))
        return self.get_batch(tenant, batch_id)

    def get_batch(self, tenant: str, batch_id: str) -> dict:
        return batch_object(self.batch_row(batch_id, tenant))

    def batch_row(self, batch_id: str, tenant: str | None = None) -> Row:
        row = self.db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None or (tenant is not None and row["tenant"] != tenant):
            raise NotFoundError(f"no batch with id {batch_id!r}", param="batch_id")
        return row

    def list_batches(self, tenant: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
        rows = self._page("batches", tenant, after, limit, "desc", "", ())
        return [batch_object(r) for r in rows[:limit]], len(rows) > limit

    def set_status(self, batch_id: str, status: str, only_from: tuple = ACTIVE) -> bool:
        """Move a batch to `status` (stamping `<status>_at`) if it is in `only_from`."""
        with self.db:
            cur = self.db.execute(
                f"UPDATE batches SET status = ?, {status}_at = ? WHERE id = ? AND status IN "
                f"({','.join('?' * len(only_from))})",
                (status, int(time.time()), batch_id, *only_from))
        return cur.rowcount == 1

    def active(self) -> list[Row]:
        return self.db.execute(
            f"SELECT * FROM batches WHERE status IN ({','.join('?' * len(ACTIVE))}) "
            "ORDER BY created_at, id", ACTIVE).fetchall()

    def recent(self, limit: int = 20) -> list[dict]:
        """Every tenant's batches, active ones first, then the newest (the dashboard)."""
        rows = self.db.execute(
            f"SELECT * FROM batches ORDER BY CASE WHEN status IN "
            f"({','.join('?' * len(ACTIVE))}) THEN 0 ELSE 1 END, created_at DESC, id DESC "
            "LIMIT ?", (*ACTIVE, limit)).fetchall()
        return [dict(batch_object(r), tenant=r["tenant"]) for r in rows]

    # ---------------------------------------------------------------- lines
    def pending(self, batch_id: str) -> list[int]:
        return [r[0] for r in self.db.execute(
            "SELECT idx FROM lines WHERE batch_id = ? AND state = 'pending' ORDER BY idx",
            (batch_id,))]

    def claim(self, batch_id: str, runner: str, n: int, lease_s: float,
              now: float) -> list[int]:
        """Up to `n` pending lines of a batch that no runner holds (never claimed, or its
        lease ran out), first in file order, now `runner`'s until now + lease_s. On
        PostgreSQL, lines another runner is claiming at the same moment are skipped
        (FOR UPDATE SKIP LOCKED), so two runners never get the same line."""
        lock = " FOR UPDATE SKIP LOCKED" if self.db.dialect == "postgresql" else ""
        with self.db:
            idxs = [r[0] for r in self.db.execute(
                "SELECT idx FROM lines WHERE batch_id = ? AND state = 'pending' AND "
                f"(lease_until IS NULL OR lease_until < ?) ORDER BY idx LIMIT ?{lock}",
                (batch_id, now, n))]
            self.db.executemany(
                "UPDATE lines SET claimed_by = ?, lease_until = ? WHERE batch_id = ? AND "
                "idx = ?", [(runner, now + lease_s, batch_id, i) for i in idxs])
        return idxs

    def release_all(self, runner: str | None = None) -> None:
        """Drop `runner`'s claims (it stops cleanly: its lines are anyone's at once), or
        every claim (a SQLite store has one runner: at its start, the claims left by its
        previous run are nobody's)."""
        self.db.execute("UPDATE lines SET claimed_by = NULL, lease_until = NULL WHERE "
                        "state = 'pending' AND claimed_by IS NOT NULL" +
                        (" AND claimed_by = ?" if runner else ""),
                        (runner,) if runner else ())

    def renew(self, runner: str, lease_s: float, now: float) -> None:
        """Extend the leases of `runner`'s pending lines."""
        self.db.execute("UPDATE lines SET lease_until = ? WHERE claimed_by = ? AND "
                        "state = 'pending'", (now + lease_s, runner))

    def claimed(self, batch_id: str, now: float) -> int:
        """Pending lines of a batch that some runner holds now (its lease running)."""
        return int(self.db.execute(
            "SELECT count(*) FROM lines WHERE batch_id = ? AND state = 'pending' AND "
            "lease_until >= ?", (batch_id, now)).fetchone()[0])

    def line(self, batch_id: str, idx: int) -> tuple[str, dict]:
        row = self.db.execute("SELECT custom_id, body FROM lines WHERE batch_id = ? AND "
                              "idx = ?", (batch_id, idx)).fetchone()
        return row[0], json.loads(row[1])

    def record(self, batch_id: str, idx: int, ok: bool, result: dict,
               usage: dict | None = None) -> bool:
        """A line's result, once; its usage and cost added to the batch's totals."""
        u = usage or {}
        cost = u.get("cost_details") or {}
        with self.db:
            cur = self.db.execute(
                "UPDATE lines SET state = ?, result = ? WHERE batch_id = ? AND idx = ? AND "
                "state = 'pending'", ("done" if ok else "failed", json.dumps(result), batch_id,
                                      idx))
            if cur.rowcount != 1:
                return False
            self.db.execute(
                "UPDATE batches SET completed = completed + ?, failed = failed + ?, "
                "prompt_tokens = prompt_tokens + ?, cached_tokens = cached_tokens + ?, "
                "output_tokens = output_tokens + ?, machine_usd = machine_usd + ?, "
                "charge_usd = charge_usd + ? WHERE id = ?",
                (int(ok), int(not ok), u.get("prompt_tokens", 0),
                 (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                 u.get("completion_tokens", 0), cost.get("machine_usd", 0.0),
                 cost.get("charge_usd", 0.0), batch_id))
        return True

    def results(self, batch_id: str) -> tuple[list[str], list[str]]:
        """The output and error file lines, in line order."""
        out, err = [], []
        for state, result in self.db.execute(
                "SELECT state, result FROM lines WHERE batch_id = ? ORDER BY idx", (batch_id,)):
            (out if state == "done" else err).append(result)
        return out, err

    def finish(self, batch_id: str, status: str, output_file_id: str | None,
               error_file_id: str | None) -> None:
        with self.db:
            self.db.execute(f"UPDATE batches SET status = ?, {status}_at = ?, "
                            "output_file_id = ?, error_file_id = ? WHERE id = ?",
                            (status, int(time.time()), output_file_id, error_file_id, batch_id))

    # -------------------------------------------------------------- helpers
    def _page(self, table: str, tenant: str, after: str | None, limit: int, order: str,
              extra: str, params: tuple) -> list[Row]:
        """Rows of `tenant` ordered by (created_at, id), `order`ed, after the cursor id."""
        op, direction = ("<", "DESC") if order == "desc" else (">", "ASC")
        cursor, cparams = "", ()
        if after:
            row = self.db.execute(f"SELECT created_at, id FROM {table} WHERE id = ? AND "
                                  "tenant = ?", (after, tenant)).fetchone()
            if row is None:
                raise NotFoundError(f"no object with id {after!r} to list after", param="after")
            cursor, cparams = f"AND (created_at, id) {op} (?, ?)", (row[0], row[1])
        return self.db.execute(
            f"SELECT * FROM {table} WHERE tenant = ? {extra} {cursor} ORDER BY created_at "
            f"{direction}, id {direction} LIMIT ?", (tenant, *params, *cparams, limit + 1)
        ).fetchall()


def file_object(row: Row) -> dict:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"],
            "created_at": row["created_at"], "filename": row["filename"],
            "purpose": row["purpose"], "status": "processed", "expires_at": None,
            "status_details": None}


def batch_object(row: Row) -> dict:
    stamps = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
              "cancelling_at", "cancelled_at")
    errors = json.loads(row["errors"]) if row["errors"] else None
    return {
        "id": row["id"], "object": "batch", "endpoint": row["endpoint"],
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
        "status": row["status"], "output_file_id": row["output_file_id"],
        "error_file_id": row["error_file_id"], "created_at": row["created_at"],
        "expires_at": row["expires_at"], **{k: row[k] for k in stamps},
        "request_counts": {"total": row["total"], "completed": row["completed"],
                           "failed": row["failed"]},
        "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
        "usage": {"input_tokens": row["prompt_tokens"],
                  "input_tokens_details": {"cached_tokens": row["cached_tokens"]},
                  "output_tokens": row["output_tokens"],
                  "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": row["prompt_tokens"] + row["output_tokens"]},
        "cost": {"machine_usd": round(row["machine_usd"], 12),
                 "charge_usd": round(row["charge_usd"], 12), "currency": "USD"},
    }
