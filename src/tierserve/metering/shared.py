"""State that several gateways of one PostgreSQL database share, so that they act as one:
budget holds with leases, and rate-limit token buckets. (With SQLite, or one gateway, the
recorder and the rate limiter keep this in memory, as before; nothing here runs.)

NOTE: holds
    A request's worst-case charge is held, before it runs, in one transaction:
    `pg_advisory_xact_lock` on the tenant (every gateway's admissions of a tenant queue
    behind one lock), then the tenant's spend this period (the ledger's rows) plus every
    live hold of it (any gateway's) against the budget, then the new holds inserted. So
    the budget is crossed by at most the last request admitted: total spend stays under
    budget + one request's worst case, however many gateways admit at once. A hold is
    settled with the request's ledger row: the ledger writer deletes it in the
    transaction that inserts the row (metering/ledger.py), so spend and holds never both
    count it, nor neither. Each hold has a lease (`lease_until`, the database's clock);
    its gateway renews all of its leases every LEASE_S / 3 and deletes expired rows. A
    gateway killed mid-flight stops renewing: its holds stop counting LEASE_S later at
    most, and their rows are deleted by the next renewal of any gateway.

NOTE: one order between tiers
    A gateway holds lower tiers back from a replica that runs its own batch (vLLM) while
    that replica's lower-tier requests are at its limit (router/flow.py). Alone, it counts
    only its own; beside others, each publishes its count per replica (by URL) every
    LOAD_INTERVAL_S (and adds the others' to its own when it scores replicas), and takes
    a slot of the limit before each lower-tier release in one transaction (an advisory
    lock per replica: its count plus the others' under the limit, its row raised), so the
    limit, and the slots it keeps free for priority, hold for all gateways together. A
    row is raised at once (a grant, or a request Envoy moved there) and lowered at the
    next publish (never from a count taken before a grant made since): never below the
    truth while the database answers and its gateway keeps publishing (a row older than
    LOAD_TTL_S stops counting, as a dead gateway's).

NOTE: buckets
    A token bucket per (tenant, requests|tokens), refilled continuously at the limit per
    minute, its level and time kept in a row. A request's take is one transaction over
    the tenant's rows (`SELECT ... FOR UPDATE`, refill by the database's clock, check,
    update), so N gateways together grant what one would: the limit holds within one
    bucket's burst. What a take costs is measured in docs/benchmarks.md (issue 31).
"""

import math
import os
import threading
import uuid

from tierserve.db import Database

LEASE_S = float(os.environ.get("TIERSERVE_LEASE_S", "30"))
"""A hold counts this long after its gateway last renewed it ($TIERSERVE_LEASE_S, which
batch lines' leases read too; every gateway of a database should use the same)."""
LOAD_TTL_S = 2.0
"""Another gateway's published replica load counts this long (it publishes every
LOAD_INTERVAL_S)."""
LOAD_INTERVAL_S = 0.1
_NOW = "extract(epoch from clock_timestamp())"
"""The database's clock (every gateway reads the same one)."""
_UPSERT_LOAD = (f"INSERT INTO replica_loads (gateway, replica, lower, at) VALUES "
                f"(?, ?, ?, {_NOW}) ON CONFLICT (gateway, replica) DO UPDATE SET "
                f"lower = excluded.lower, at = excluded.at")


def migrate_shared(db: Database) -> None:
    """The tables (a ledger migration calls this)."""
    db.ddl("""
        CREATE TABLE holds (
            request_id TEXT PRIMARY KEY,
            tenant TEXT NOT NULL,
            usd REAL NOT NULL,             -- worst-case charge held
            gateway TEXT NOT NULL,
            lease_until REAL NOT NULL      -- unix seconds (the database's clock)
        )""")
    db.ddl("CREATE INDEX holds_tenant ON holds (tenant)")
    db.ddl("CREATE INDEX holds_gateway ON holds (gateway)")
    db.ddl("""
        CREATE TABLE buckets (
            tenant TEXT NOT NULL,
            kind TEXT NOT NULL,            -- requests or tokens
            level REAL NOT NULL,
            at REAL NOT NULL,              -- unix seconds of `level`
            PRIMARY KEY (tenant, kind)
        )""")
    db.ddl("""
        CREATE TABLE replica_loads (
            gateway TEXT NOT NULL,
            replica TEXT NOT NULL,         -- its URL: the same replica for every gateway
            lower INTEGER NOT NULL,        -- lower-tier requests this gateway has on it
            at REAL NOT NULL,              -- unix seconds (the database's clock)
            PRIMARY KEY (gateway, replica)
        )""")


class Refused(Exception):
    """A hold or take that does not fit: what was found (nothing was taken)."""

    def __init__(self, **found):
        super().__init__(found)
        self.found = found


class SharedState:
    """One gateway's connection to the shared rows (thread-safe: one lock, one
    connection), and the thread that renews its leases."""

    def __init__(self, target: str, gateway: str | None = None):
        self.target = target
        self.gateway = gateway or f"gw-{uuid.uuid4().hex[:12]}"
        self._db = Database(target)
        self._lock = threading.Lock()
        self.granted: dict[str, int] = {}
        """Replica URL -> times this gateway's row there was raised (`acquire_lower`'s
        grants, `raise_lower`): a count of `mine` taken before one is stale (see
        `exchange_loads`)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name="leases", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            self._db.close()

    # ---------------------------------------------------------------- holds
    def hold(self, tenant: str, budget_usd: float, period_start: float,
             holds: list[tuple[str, float]]) -> tuple[float, float]:
        """Hold each (request id, USD) against the tenant's budget, or raise Refused
        holding nothing. Returns (spent, held) as found, before these."""
        with self._lock, self._db as db:
            db.execute("SELECT pg_advisory_xact_lock(hashtext(?))", (f"budget:{tenant}",))
            spent = float(db.execute(
                "SELECT coalesce(sum(charge), 0) FROM requests WHERE tenant = ? AND "
                "time >= ?", (tenant, period_start)).fetchone()[0])
            held = float(db.execute(
                f"SELECT coalesce(sum(usd), 0) FROM holds WHERE tenant = ? AND "
                f"lease_until > {_NOW}", (tenant,)).fetchone()[0])
            if spent + held >= budget_usd:
                raise Refused(spent=spent, held=held)
            db.executemany(
                f"INSERT INTO holds (request_id, tenant, usd, gateway, lease_until) VALUES "
                f"(?, ?, ?, ?, {_NOW} + {LEASE_S})",
                [(rid, tenant, usd, self.gateway) for rid, usd in holds])
            return spent, held

    def release(self, request_ids: list[str]) -> None:
        """Drop holds of requests that never ran (refused later in admission)."""
        if request_ids:
            with self._lock:
                self._db.executemany("DELETE FROM holds WHERE request_id = ?",
                                     [(r,) for r in request_ids])

    def renew(self) -> int:
        """Extend this gateway's leases; delete every expired hold (any gateway's).
        Returns how many expired rows were deleted."""
        with self._lock, self._db as db:
            db.execute(f"UPDATE holds SET lease_until = {_NOW} + {LEASE_S} WHERE gateway = ?",
                       (self.gateway,))
            cur = db.execute(f"DELETE FROM holds WHERE lease_until <= {_NOW}")
            return cur.rowcount or 0

    def _renew_loop(self) -> None:
        while not self._stop.wait(LEASE_S / 3):
            try:
                self.renew()
            except Exception:  # a database blip: the next round tries again
                pass

    # --------------------------------------------------------- replica load
    def exchange_loads(self, mine: dict[str, int],
                       granted: dict[str, int] | None = None) -> dict[str, int]:
        """Publish this gateway's lower-tier requests per replica URL; return the other
        gateways' (their rows of the last LOAD_TTL_S: a dead gateway's drop out).

        `granted` is `self.granted` as it was when `mine` was counted. A replica granted
        a slot since then keeps its row as `acquire_lower` left it: the count is from
        before that grant, and writing it would put the row below the truth (the next
        exchange publishes the decrease)."""
        with self._lock, self._db as db:
            if granted is not None:
                mine = {url: n for url, n in mine.items()
                        if self.granted.get(url, 0) == granted.get(url, 0)}
            db.executemany(_UPSERT_LOAD, [(self.gateway, url, n) for url, n in mine.items()])
            rows = db.execute(
                f"SELECT replica, sum(lower) FROM replica_loads WHERE gateway != ? AND "
                f"at > {_NOW} - {LOAD_TTL_S} GROUP BY replica", (self.gateway,)).fetchall()
        return {url: int(n) for url, n in rows}

    def acquire_lower(self, replica: str, mine: int, limit: int) -> bool:
        """Whether this gateway may send one more lower-tier request to `replica` (URL):
        its `mine` plus every other gateway's live count stays under `limit`. Granted, its
        row becomes mine + 1 in the same transaction (others see it at once); decreases
        are published by `exchange_loads`, so a row is never below the truth."""
        with self._lock, self._db as db:
            db.execute("SELECT pg_advisory_xact_lock(hashtext(?))", (f"replica:{replica}",))
            others = int(db.execute(
                f"SELECT coalesce(sum(lower), 0) FROM replica_loads WHERE replica = ? AND "
                f"gateway != ? AND at > {_NOW} - {LOAD_TTL_S}",
                (replica, self.gateway)).fetchone()[0])
            if mine + others + 1 > limit:
                return False
            db.execute(_UPSERT_LOAD, (self.gateway, replica, mine + 1))
            self.granted[replica] = self.granted.get(replica, 0) + 1
            return True

    def raise_lower(self, replica: str, mine: int) -> None:
        """This gateway's count on `replica` rose to `mine` without a grant (Envoy retried
        a request there): its row rises at once, as after a grant."""
        with self._lock, self._db as db:
            db.execute(_UPSERT_LOAD, (self.gateway, replica, mine))
            self.granted[replica] = self.granted.get(replica, 0) + 1

    # -------------------------------------------------------------- buckets
    def take(self, tenant: str, wants: list[tuple[str, float, float]]) -> dict[str, tuple]:
        """Take from each (kind, per_minute, amount) bucket of `tenant`, or raise Refused
        (with `wait_s`, the kind, and the levels) taking nothing. Returns kind ->
        (capacity, level after, reset seconds)."""
        with self._lock, self._db as db:
            now = float(db.execute(f"SELECT {_NOW}").fetchone()[0])
            levels = {}
            for kind, per_minute, _ in wants:
                db.execute("INSERT INTO buckets (tenant, kind, level, at) VALUES (?, ?, ?, ?) "
                           "ON CONFLICT (tenant, kind) DO NOTHING",
                           (tenant, kind, float(per_minute), now))
                level, at = db.execute("SELECT level, at FROM buckets WHERE tenant = ? AND "
                                       "kind = ? FOR UPDATE", (tenant, kind)).fetchone()
                levels[kind] = min(float(per_minute),
                                   float(level) + max(0.0, now - float(at)) * per_minute / 60)
            waits = [((amount - levels[kind]) * 60 / per_minute
                      if amount <= per_minute else math.inf, kind)
                     for kind, per_minute, amount in wants]
            wait, kind = max(waits, default=(0.0, ""))
            if wait > 0:
                raise Refused(wait_s=wait, kind=kind, levels=levels)
            out = {}
            for kind, per_minute, amount in wants:
                left = levels[kind] - amount
                db.execute("UPDATE buckets SET level = ?, at = ? WHERE tenant = ? AND "
                           "kind = ?", (left, now, tenant, kind))
                out[kind] = (float(per_minute), left, (per_minute - left) * 60 / per_minute)
            return out

    def give_back(self, tenant: str, gives: list[tuple[str, float, float]]) -> None:
        """Return (kind, per_minute, amount) to the tenant's buckets (up to full)."""
        with self._lock, self._db as db:
            for kind, per_minute, amount in gives:
                db.execute("UPDATE buckets SET level = least(?, level + ?) WHERE tenant = ? "
                           "AND kind = ?", (float(per_minute), amount, tenant, kind))

    def reset(self, tenant: str) -> None:
        """A tenant's limits changed: its buckets start full again."""
        with self._lock:
            self._db.execute("DELETE FROM buckets WHERE tenant = ?", (tenant,))

