"""Cost for a replica the gateway cannot see inside: its machine cost over time, split
among the requests it was running, step by step as the gateway sees them.

NOTE: the split
    A replica streams each running sequence's token at the end of every step, so the
    gateway sees the steps as clusters of token events (a cluster: events less than
    MIN_INTERVAL_S apart). The time from one cluster to the next is one interval, closed
    when the cluster is complete (the next event comes later), and split like the engine
    meter splits a step (metering/cost.py): each sequence's own work from the step-time
    model (core/step_time.py), plus an equal part of the fixed per-step work:
      decode   every request past its first token was in the step: seq_cost(1, context);
      prefill  a request whose first token ends the interval: what is left of its
               prompt's work W = seq_cost(prompt - cached, prompt);
      queued   a request sent but without a token yet takes part only in time the known
               work does not explain: the interval's length beyond what the model predicts
               for it (scaled by what decode-only intervals measured against the model),
               given to the oldest such requests first, each up to what is left of its W.
               A long prompt prefilled in chunks over several steps is charged in them;
               one that waited in the replica's queue is not.
    An interval in which nothing ran is idle. Each interval's cost is fully attributed:
    per replica, requests + idle == machine cost (property-tested), and the estimate is
    checked against a tierserve replica's exact meter (bench fleet metering).

NOTE: how it is fed
    `FleetMetering` is fleet mode's metering in the one request accounting
    (core/accounting.py), where an engine has `EngineMetering`: the accounting's request
    events (scheduled on a replica, tokens, left it) drive that replica's meter, and a
    request's cost is the sum over its attempts; when it finishes, the recorder charges
    and records it exactly as an engine's.

NOTE: exact costs replace the estimate
    A replica that meters itself (tierserve, or vLLM with tierserve's plugin) reports
    each request's exact cost. Its last attempt is then billed at that figure instead of
    the estimate, and the difference moves to that replica's idle cost (the estimate had
    split the same machine time otherwise), so per replica requests + idle still equal
    the machine cost; the pair (estimate, exact) is kept to say how good the estimate is.
"""

from collections import defaultdict, deque
from dataclasses import dataclass

from tierserve.core.stats import Bill, Metering, RequestCost
from tierserve.core.step_time import StepTimeModel
from tierserve.metering.cost import CostMeter, IdleInterval

MIN_INTERVAL_S = 0.002
"""Events closer than this belong to one step: a replica's chunks for a whole batch
arrive within a millisecond."""
SCALE_SMOOTHING = 0.1
"""How fast the measured/predicted ratio of decode-only intervals follows the replica."""


@dataclass
class _Running:
    sent: float
    prefill_left: float
    """Model seconds of prefill work not yet attributed."""
    decoding: bool = False
    context: int = 0


class ReplicaMeter(CostMeter):
    """A CostMeter fed by request events instead of engine steps."""

    def __init__(self, price_per_hour: float, work_model: StepTimeModel):
        super().__init__(price_per_hour, work_model=work_model)
        self.running: dict[str, _Running] = {}
        self.attributed = 0.0
        """Machine cost given to requests so far (the rest is idle)."""
        self.scale = 1.0
        """Measured / predicted length of decode-only intervals (smoothed)."""
        self._t: float | None = None
        """Start of the open interval (the end of the last one)."""
        self._cluster_end: float | None = None
        """Last token event of the step being gathered; None before its first."""
        self._firsts: set[str] = set()

    def start(self, request_id: str, now: float, prompt_tokens: int,
              cached_tokens: int = 0) -> None:
        self._flush(now)
        if not self.running:  # the replica was idle until now
            self._close(now)
        new = max(1, prompt_tokens - cached_tokens)
        self.running[request_id] = _Running(now, self.work_model.seq_cost_s(new, prompt_tokens),
                                            context=prompt_tokens)

    def tokens(self, request_id: str, now: float, n: int = 1) -> None:
        """`n` output tokens arrived for the request (its first ones end its prefill)."""
        self._flush(now)
        run = self.running.get(request_id)
        if run is None or n <= 0:
            return
        if not run.decoding:
            run.decoding = True
            self._firsts.add(request_id)
        run.context += n
        self._cluster_end = now

    def finish(self, request_id: str, now: float) -> RequestCost:
        """The request left the replica: its cost so far (forgotten here)."""
        self._flush(now)
        self._close(now)
        self.running.pop(request_id, None)
        return self.take(request_id)

    def close_window(self, now: float) -> None:
        """Idle time up to `now` is accounted; a replica at work keeps its interval."""
        self._flush(now)
        if not self.running:
            self._close(now)

    # ------------------------------------------------------------ intervals
    def _flush(self, now: float) -> None:
        """Close the gathered step if `now` is past it."""
        if self._cluster_end is not None and now - self._cluster_end >= MIN_INTERVAL_S:
            self._close(self._cluster_end)

    def _close(self, end: float) -> None:
        """Split the interval up to `end` among the requests that worked in it."""
        if self._t is None:
            self._t = self._last_end = end
            return
        dt = end - self._t
        if dt <= 0:
            return
        m = self.work_model
        work: dict[str, tuple[float, bool]] = {}  # request -> (model seconds, is prefill)
        for rid, run in self.running.items():
            if rid in self._firsts:
                work[rid] = (run.prefill_left, True)
                run.prefill_left = 0.0
            elif run.decoding:
                work[rid] = (m.seq_cost_s(1, run.context), False)
        predicted = m.fixed_s + sum(w for w, _ in work.values()) if work else 0.0
        queued = sorted((run.sent, rid) for rid, run in self.running.items()
                        if not run.decoding and run.prefill_left > 0)
        if work and not queued and not self._firsts and predicted > 0:
            self.scale += SCALE_SMOOTHING * (dt / predicted - self.scale)
        unexplained = dt / self.scale - predicted  # all of it when nothing else ran
        for _, rid in queued:
            if unexplained <= 0:
                break
            run = self.running[rid]
            w = min(run.prefill_left, unexplained)
            run.prefill_left -= w
            unexplained -= w
            work[rid] = (w, True)
        if work:
            self._split(dt, work)
        else:
            self._add_idle(end)
        self._t = self._last_end = end
        self._cluster_end = None
        self._firsts.clear()

    def reattribute(self, estimate: float, exact: float) -> None:
        """A request's estimated cost was replaced by the exact one its replica reported:
        the difference moves to idle, so requests + idle still equal the machine cost."""
        delta = estimate - exact
        self.attributed -= delta
        self.idle_cost += delta
        at = self._last_end if self._last_end is not None else 0.0
        if self._idle is None:
            self._idle = IdleInterval(at, at, 0.0, 0.0)
        self._idle.cost += delta

    def _split(self, dt: float, work: dict[str, tuple[float, bool]]) -> None:
        fixed = self.work_model.fixed_s / len(work)
        total = sum(w for w, _ in work.values()) + self.work_model.fixed_s
        cost = dt * self.price_per_second
        self.machine_cost += cost
        for rid, (w, is_prefill) in work.items():
            rc = self.costs[rid]
            share = cost * (w + fixed) / total if total > 0 else cost / len(work)
            self.attributed += share
            if is_prefill:
                rc.prefill_cost += share
            else:
                rc.decode_cost += share
            rc.num_steps += 1
            rc.batch_size_sum += len(work)


class FleetMetering(Metering):
    """The replicas' meters behind one accounting: a request's events go to the meter of
    the replica it runs on (`stats.engine`), its cost is summed over attempts, and the
    recorder charges it once."""

    def __init__(self, recorder, meters: dict[str, ReplicaMeter]):
        """`recorder`: metering.recorder.Recorder (it also accrues the meters' idle time)."""
        self.recorder, self.meters = recorder, meters
        for meter in meters.values():
            recorder.add_meter(meter)
        self._costs: defaultdict[str, RequestCost] = defaultdict(RequestCost)
        self._last: dict[str, tuple[str, RequestCost]] = {}
        """Request id -> (replica, estimated cost) of its latest attempt."""
        self._reported: dict[str, RequestCost] = {}
        self.cost_checks: deque[tuple[RequestCost, RequestCost]] = deque(maxlen=10_000)
        """(estimated, reported) machine cost of recent requests whose replica reported its
        exact cost: how good the estimate is."""

    def on_scheduled(self, stats, now: float) -> None:
        self.meters[stats.engine].start(stats.request_id, now, stats.num_prompt_tokens)

    def on_tokens(self, stats, n: int, now: float) -> None:
        self.meters[stats.engine].tokens(stats.request_id, now, n)

    def on_left(self, stats, now: float) -> None:
        part = self.meters[stats.engine].finish(stats.request_id, now)
        cost = self._costs[stats.request_id]
        cost.prefill_cost += part.prefill_cost
        cost.decode_cost += part.decode_cost
        cost.num_steps += part.num_steps
        cost.batch_size_sum += part.batch_size_sum
        self._last[stats.request_id] = (stats.engine, part)
        self.recorder.flush_idle()  # replicas' idle time to the ledger as it closes

    def on_reported_cost(self, stats, cost: RequestCost) -> None:
        seen = self._reported.setdefault(stats.request_id, RequestCost())
        seen.prefill_cost += cost.prefill_cost
        seen.decode_cost += cost.decode_cost

    def on_request_finished(self, stats) -> Bill:
        rid = stats.request_id
        cost = self._costs.pop(rid, None) or RequestCost()
        last = self._last.pop(rid, None)
        reported = self._reported.pop(rid, None)
        note = None
        if reported is not None and last is not None:
            replica, part = last
            self.cost_checks.append((part, reported))
            cost = RequestCost(cost.prefill_cost - part.prefill_cost + reported.prefill_cost,
                               cost.decode_cost - part.decode_cost + reported.decode_cost,
                               cost.num_steps, cost.batch_size_sum)
            self.meters[replica].reattribute(part.machine_cost, reported.machine_cost)
            note = {"cost": "exact", "estimated_machine_usd": part.machine_cost}
        return Bill(cost, self.recorder.finished(stats, cost, note))
