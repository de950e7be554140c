"""The batch runner: feeds pending lines of active batches to the engine in the `batch`
tier, a bounded number at a time, records each result once, and finalizes each batch.

NOTE: order and bounds
    Batches run oldest first, lines in file order; at most `max_in_flight` lines are in the
    engine at once, across all batches (the default is twice the engine's `max_num_seqs`,
    so a line is always waiting when one finishes). In the engine the batch tier is the
    last one served and the first preempted, so interactive traffic keeps its latency.

NOTE: cancel and expiry
    Cancelling (or passing `expires_at`) stops feeding the batch's lines; the lines already
    in the engine run to the end and their results are kept, since their tokens are mostly
    paid for. Then the batch is finalized: lines that never ran go to the error file with
    code `batch_cancelled` (or `batch_expired`) and count as failed, so `completed + failed
    = total` in every final state.

NOTE: restarts
    State lives in the store (see its note); the runner's own state is what is in flight.
    A line runs under one request id made from its batch and index (`line_request_id`):
    the ledger row, the output line's `id` and `request_id`, and the response's `id`. Its
    result is recorded only after its ledger row is committed (the request path waits for
    that), and the ledger keeps one row per id; so a line that finished just before a
    crash runs again after the restart and is charged once, for the answer kept.
    On start, a batch found `finalizing` is finalized again, one `cancelling` is cancelled,
    and the pending lines of the others are fed from the first.

NOTE: several gateways
    Gateways sharing one database share the batches: each runner claims the lines it
    feeds (`BatchStore.claim`, a lease of LEASE_S renewed every LEASE_S / 3), so a line
    runs on one gateway at a time; a gateway killed mid-batch stops renewing, and once
    its leases run out another runner claims those lines and runs them. The line's
    request id is the same on every run, so its ledger row is one row. A batch is
    finalized once none of its lines is pending (completed) or held by a live lease
    (cancelled, expired); a batch found `finalizing` is finalized again only when that
    began LEASE_S ago (its finalizer died). The output files are written under the
    finalizing gateway's data directory: gateways sharing a database share it too.
"""

import asyncio
import logging
import os
import time
import uuid

from tierserve.batch.store import BatchStore

LEASE_S = float(os.environ.get("TIERSERVE_LEASE_S", "30"))
"""A claimed line is its runner's this long after the last renewal ($TIERSERVE_LEASE_S)."""


def line_request_id(batch_id: str, idx: int) -> str:
    """The request id of line `idx` of a batch, the same on every run of the line."""
    return f"batch_req_{batch_id.removeprefix('batch_')}_{idx}"

log = logging.getLogger("tierserve.batch")


class BatchRunner:
    def __init__(self, store: BatchStore, execute, max_in_flight: int, clock=time.time,
                 hold=None):
        """`execute(batch_row, custom_id, body, request_id) -> (status_code,
        response_body)` runs one line (server.completions.execute behind a closure).
        `hold(batch_row, now) -> bool`: whether to feed none of its lines now (a capacity
        schedule's peak; lines in flight run on)."""
        self.store, self.execute = store, execute
        self.hold = hold
        self.max_in_flight = max(1, max_in_flight)
        self.clock = clock
        self.name = f"runner-{uuid.uuid4().hex[:12]}"
        """Whose claims are whose (one per process and start)."""
        self._renewed = 0.0
        self._in_flight: dict[tuple[str, int], asyncio.Task] = {}
        self._wake = asyncio.Event()
        self.idle = asyncio.Event()
        """Set while nothing is pending or in flight (tests and benchmarks wait on it)."""

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        if self.store.db.dialect == "sqlite":  # one runner: the last run's claims are void
            self.store.release_all()
        try:
            while True:
                self._step()
                # Woken by a line, an API call, or after 1 s (expiry). Not wait_for: on
                # Python 3.11 it can swallow a cancel that lands as the wait ends, and
                # the server's shutdown would then wait on this loop forever.
                timer = asyncio.get_running_loop().call_later(1.0, self._wake.set)
                try:
                    await self._wake.wait()
                finally:
                    timer.cancel()
                self._wake.clear()
        finally:
            tasks = list(self._in_flight.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            try:  # a clean stop: its lines are another runner's at once, not in a lease
                self.store.release_all(self.name)
            except Exception as exc:
                log.warning("batch claims of %s not released (%s); they lapse in %g s",
                            self.name, exc, LEASE_S)

    def _step(self) -> None:
        now = self.clock()
        if self._in_flight and now - self._renewed >= LEASE_S / 3:
            self.store.renew(self.name, LEASE_S, now)
            self._renewed = now
        busy = False
        for batch in self.store.active():
            bid, status = batch["id"], batch["status"]
            if status == "in_progress" and now >= batch["expires_at"]:
                status = "expiring"
            if status == "in_progress" and self.hold is not None and self.hold(batch, now):
                busy = True
                continue
            if status == "in_progress":
                room = self.max_in_flight - len(self._in_flight)
                for idx in self.store.claim(bid, self.name, room, LEASE_S, now) if room > 0 \
                        else ():
                    self._in_flight[bid, idx] = asyncio.create_task(self._run_line(batch, idx))
                if self._has_in_flight(bid) or self.store.pending(bid):
                    busy = True  # lines left here, or held by another gateway's runner
                    continue
                self._finalize(batch, "completed")
            elif self._has_in_flight(bid) or (
                    status != "finalizing" and self.store.claimed(bid, now)):
                busy = True  # running lines end first (here or on another gateway)
            elif status == "finalizing" and self.store.db.dialect == "postgresql" and \
                    now - (batch["finalizing_at"] or 0) < LEASE_S:
                busy = True  # another gateway is writing its files
            else:
                final = {"cancelling": "cancelled", "expiring": "expired"}.get(status,
                                                                               "completed")
                self._finalize(batch, final)
        if busy:
            self.idle.clear()
        else:
            self.idle.set()

    def _has_in_flight(self, batch_id: str) -> bool:
        return any(b == batch_id for b, _ in self._in_flight)

    async def _run_line(self, batch, idx: int) -> None:
        bid = batch["id"]
        rid = line_request_id(bid, idx)
        try:
            custom_id, body = self.store.line(bid, idx)
            try:
                status, response = await self.execute(batch, custom_id, body, rid)
            except asyncio.CancelledError:
                raise  # shutting down: the line stays pending and runs after a restart
            except Exception as exc:  # a bug, not the line's fault: fail the line, say why
                log.exception("batch %s line %d", bid, idx)
                status, response = 500, {"error": {"message": f"internal error: {exc}",
                                                   "type": "server_error", "param": None,
                                                   "code": "internal_error"}}
            result = {"id": rid, "custom_id": custom_id,
                      "response": {"status_code": status, "request_id": rid,
                                   "body": response},
                      "error": None}
            self.store.record(bid, idx, status == 200, result, response.get("usage"))
        finally:
            self._in_flight.pop((bid, idx), None)
            self._wake.set()

    def _finalize(self, batch, status: str) -> None:
        """Write the output and error files and mark the batch final (see the notes)."""
        bid = batch["id"]
        code = {"cancelled": "batch_cancelled", "expired": "batch_expired"}.get(status)
        if code is None:  # cancelled and expired batches go straight to their final state
            if not self.store.set_status(bid, "finalizing", only_from=(batch["status"],)):
                return  # another gateway's runner got there first
        for idx in self.store.pending(bid):
            assert code is not None, f"batch {bid} line {idx} pending at completion"
            custom_id, _ = self.store.line(bid, idx)
            self.store.record(bid, idx, False, {
                "id": line_request_id(bid, idx), "custom_id": custom_id, "response": None,
                "error": {"code": code, "message": f"the batch was {status} before this line "
                                                   "ran"}})
        out, err = self.store.results(bid)
        tenant = batch["tenant"]
        self.store.finish(bid, status,
                          self.store.write_file(tenant, f"{bid}_output.jsonl", out),
                          self.store.write_file(tenant, f"{bid}_error.jsonl", err))
        log.info("batch %s %s: %d output lines, %d error lines", bid, status, len(out),
                 len(err))

