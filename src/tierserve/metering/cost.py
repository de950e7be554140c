"""The cost meter: every engine step's machine cost, split among the requests in it.

NOTE: the work model
    A step of `d` seconds on a machine priced `p` per second costs `C = d * p`. Who used it
    is read off the step-time model (core/step_time.py) the scheduler already has: a step
    predicted to take `fixed + sum(seq_cost_i)` spends `fixed` on what every step pays
    once (streaming the weights, launch and Python overhead) and `seq_cost_i` on sequence
    i's own work (its tokens through the linear layers, its KV reads or attention pairs).
    So sequence i is charged

        C * (fixed / n + seq_cost_i) / (fixed + sum_j seq_cost_j)

    the fixed part shared equally by the n sequences of the step, the rest by work. The
    shares sum to C exactly; each is >= 0; it grows with the sequence's own work; and the
    same sequence in a bigger batch pays a smaller share of the fixed part (cheaper per
    token, which is the whole economics of batching). A decode's share is decode cost, a
    prefill chunk's (recomputation after preemption included) is prefill cost.

    Time between steps is idle: the machine is paid for and nothing runs. It is charged to
    `idle`, except the share held for the fast lane (reserved priority slots, or a whole
    dedicated priority engine), which is charged to `priority-reserved`. Idle time is
    booked as it passes, not only when the next step starts: a step's start books the
    idle time before it, and `close_window(now)` (every scrape, dashboard poll and
    ledger flush) books it up to now unless a step is running, whose time is the step's.
    The engine's thread books steps while the event loop reads totals, so both hold a
    lock.

    Invariant (tested): sum of request costs + idle costs == machine cost of the window.
"""

import threading
from collections import defaultdict
from dataclasses import dataclass, field

from tierserve.core.stats import Bill, Metering, RequestCost
from tierserve.core.step_time import StepTimeModel

EQUAL_WORK = StepTimeModel(fixed_s=0.0, per_seq_s=0.0, per_token_s=1.0)
"""Fallback work model without a calibration: cost by token count alone."""


@dataclass
class IdleInterval:
    start: float
    end: float
    cost: float
    """Unreserved idle cost."""
    reserved_cost: float
    """Idle cost of capacity held for the fast lane."""


@dataclass
class CostMeter(Metering):
    """A stat sink: attributes each step's cost (`on_step`) and hands each request its
    total when it finishes (`on_request_finished`). Idle time between steps accumulates
    into intervals."""

    price_per_hour: float
    work_model: StepTimeModel = EQUAL_WORK
    reserved_fraction: float = 0.0
    """Share of idle time held for the fast lane (reserved slots / max_num_seqs; 1.0 for
    a dedicated priority engine)."""
    idle_interval_s: float = 60.0
    """Idle time is reported in intervals of about this length."""
    costs: dict[str, RequestCost] = field(default_factory=lambda: defaultdict(RequestCost))
    machine_cost: float = 0.0
    idle_cost: float = 0.0
    reserved_idle_cost: float = 0.0
    _last_end: float | None = None
    _busy: bool = False
    """A step is running (started, not yet booked)."""
    _idle: IdleInterval | None = None
    closed_idle: list[IdleInterval] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def price_per_second(self) -> float:
        return self.price_per_hour / 3600.0

    # ---------------------------------------------------------------- steps
    def on_step(self, stats) -> None:
        """`stats`: engine.stats.StepStats (start_time, duration_s, seqs)."""
        self.record_step(stats.start_time, stats.duration_s,
                         [(s.request_id, s.num_tokens, s.context_len, s.is_decode)
                          for s in stats.seqs])

    def on_step_starting(self, start: float) -> None:
        """A step starts now: the idle time before it is booked, and none after it until
        the step is (record_step)."""
        with self._lock:
            self._add_idle(start)
            self._busy = True

    def record_step(self, start: float, duration_s: float,
                    seqs: list[tuple[str, int, int, bool]]) -> None:
        """A step from `start`: idle time since the last one, then the step's split."""
        with self._lock:
            self._add_idle(start)
            self.attribute(duration_s, seqs)
            self._last_end = start + duration_s
            self._busy = False

    def attribute(self, duration_s: float, seqs: list[tuple[str, int, int, bool]]) -> None:
        """Split one step among its (request_id, num_tokens, context_len, is_decode)."""
        cost = duration_s * self.price_per_second
        self.machine_cost += cost
        if not seqs:
            self._charge_idle(cost, cost * self.reserved_fraction)
            return
        for (request_id, _, _, is_decode), share in zip(seqs, self.shares(cost, seqs)):
            rc = self.costs[request_id]
            if is_decode:
                rc.decode_cost += share
            else:
                rc.prefill_cost += share
            rc.num_steps += 1
            rc.batch_size_sum += len(seqs)

    def shares(self, cost: float, seqs: list[tuple[str, int, int, bool]]) -> list[float]:
        m, n = self.work_model, len(seqs)
        work = [m.fixed_s / n + m.seq_cost_s(tokens, ctx) for _, tokens, ctx, _ in seqs]
        total = sum(work)
        if total <= 0:
            return [cost / n] * n
        return [cost * w / total for w in work]

    def on_request_finished(self, stats) -> Bill:
        """The finished request's machine cost (forgotten here); no charge: prices are
        the recorder's (metering/recorder.py)."""
        return Bill(self.take(stats.request_id))

    def take(self, request_id: str) -> RequestCost:
        return self.costs.pop(request_id, None) or RequestCost()

    # ----------------------------------------------------------------- idle
    def close_window(self, now: float) -> None:
        """Account idle time up to `now` (before reading totals or at shutdown), unless a
        step is running: its time is the step's, booked when it ends."""
        with self._lock:
            if not self._busy:
                self._add_idle(now)

    def _add_idle(self, start: float) -> None:
        """Book the time from the last booked instant to `start` as idle."""
        if self._last_end is None:
            self._last_end = start
            return
        gap = start - self._last_end
        if gap <= 0:
            return
        cost = gap * self.price_per_second
        self.machine_cost += cost
        reserved = cost * self.reserved_fraction
        self._charge_idle(cost, reserved)
        if self._idle is None:
            self._idle = IdleInterval(self._last_end, start, 0.0, 0.0)
        self._idle.end = start
        self._idle.cost += cost - reserved
        self._idle.reserved_cost += reserved
        if self._idle.end - self._idle.start >= self.idle_interval_s:
            self.closed_idle.append(self._idle)
            self._idle = None
        self._last_end = start

    def _charge_idle(self, cost: float, reserved: float) -> None:
        self.idle_cost += cost - reserved
        self.reserved_idle_cost += reserved

    def take_idle(self, flush: bool = False) -> list[IdleInterval]:
        """Closed idle intervals (and with `flush` the open one), forgotten here."""
        with self._lock:
            if flush and self._idle is not None:
                self.closed_idle.append(self._idle)
                self._idle = None
            out, self.closed_idle = self.closed_idle, []
        return out
