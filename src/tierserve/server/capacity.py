"""A capacity schedule applied live (YAML `schedule:`, schedule.py's format, as
`tierserve plan --forecast` writes it).

At each entry's start the server sets, without a restart and without dropping a request,
what each backend can take (`Backend.reconfigure`):
  - on each in-process engine: max_num_seqs, the step's token budget, the priority
    reserve and the priority step-time cap of the entry (the first two never above what
    the engine was started with: its buffers and KV pool were sized for those);
  - in fleet mode: the gateway's priority reserve per replica;
  - batch jobs: outside the entries that allow batch work, a batch whose completion window
    still holds a whole batch entry after the next one starts waits for it (lines in
    flight run on); one whose window would run out runs at once.
The replica counts are for an autoscaler, which this server cannot start machines for:
`GET /v1/schedule` and the gauge `tierserve_schedule_replicas{pool}` give what to have
ready now (the pre-warm lead is already in them); the gateway routes to the replicas
that answer their health checks, so new ones join as they come up.
"""

import asyncio
import contextlib
import time

from prometheus_client import Gauge

from tierserve.tasks import background


class Capacity:
    def __init__(self, state, schedule, clock=time.time):
        self.state, self.schedule, self.clock = state, schedule, clock
        self.index: int | None = None
        self.applied: dict = {}
        r = state.metrics.registry
        self.replicas_gauge = Gauge("tierserve_schedule_replicas", "Replicas the capacity "
                                    "schedule wants ready now, per pool (pre-warm included).",
                                    ["pool"], registry=r)
        self.entry_gauge = Gauge("tierserve_schedule_entry", "Index of the schedule entry "
                                 "in force.", registry=r)
        self.batch_gauge = Gauge("tierserve_schedule_batch_open", "1 while the schedule "
                                 "lets batch lines run.", registry=r)

    # ---------------------------------------------------------------- applying
    def apply(self, now: float | None = None) -> bool:
        """Set the entry in force at `now`; whether it changed."""
        now = self.clock() if now is None else now
        index = self.schedule.index_at(now)
        if index == self.index or not self.state.served:
            return False
        entry = self.schedule.hours[index]
        for served in self.state.served.values():
            self.applied = served.backend.reconfigure(entry)
        for pool, n in entry.replicas.items():
            self.replicas_gauge.labels(pool).set(n)
        self.entry_gauge.set(index)
        self.batch_gauge.set(1 if entry.batch else 0)
        self.index = index
        if self.state.batches is not None:
            self.state.batches.wake()
        return True

    def restore(self) -> None:
        """Put each backend back as it was started (an engine may outlive a server)."""
        for served in self.state.served.values():
            served.backend.restore()
        self.index = None

    # ----------------------------------------------------------------- batches
    def hold_batch(self, batch, now: float) -> bool:
        """Whether a batch's lines wait now: outside a batch entry, if its window still
        holds a whole batch entry after the next one starts."""
        s = self.schedule
        if s.entry_at(now).batch:
            return False
        start = s.next_batch_start(now)
        return start is not None and start + s.hour_s <= batch["expires_at"]

    # ------------------------------------------------------------------ reading
    def status(self) -> dict:
        now = self.clock()
        s = self.schedule
        index = s.index_at(now)
        entry = s.hours[index]
        return {"object": "schedule", "entry": index, "now": now,
                "next_change_at": s.next_change(now), "hour_s": s.hour_s,
                "replicas": dict(entry.replicas), "need": dict(entry.need),
                "batch_open": entry.batch, "next_batch_at": s.next_batch_start(now),
                "planned": {"max_num_seqs": entry.max_num_seqs,
                            "max_num_batched_tokens": entry.max_num_batched_tokens,
                            "reserved_priority_seqs": entry.reserved_priority_seqs,
                            "priority_step_time_s": entry.priority_step_time_s},
                "applied": dict(self.applied)}


@contextlib.asynccontextmanager
async def following(state):
    """Apply the schedule at each entry's start while the server runs."""
    capacity = state.capacity
    if capacity is None:
        yield
        return

    async def loop():
        while True:
            capacity.apply()
            wait = capacity.schedule.next_change(capacity.clock()) - capacity.clock()
            await asyncio.sleep(min(max(wait, 0.01), 1.0))  # 1 s: a backend attached late

    try:
        async with background(loop()):
            yield
    finally:
        capacity.restore()
