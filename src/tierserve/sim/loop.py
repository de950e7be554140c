"""The simulator's event loop: the production scheduler, block manager and cost meter,
driven by a manual clock and a step-time model instead of a model runner.

NOTE: the loop
    Events sit in a heap ordered by (time, kind, sequence number), so equal times resolve
    the same way every run: a step's completion first, then arrivals. Processing an event
    never starts a step directly; once every event of the current instant is processed,
    if no step is in flight and the scheduler has work, the next step is planned (`Scheduler.schedule`, exactly as the
    engine does), its duration predicted by the step-time model, and its completion
    pushed. A completion applies the step (`Scheduler.update`): requests get their token
    (a fixed token id; outputs run to their workload length with EOS ignored), finished
    ones are recorded, and closed-loop users send their next request. Same seed, same
    events, same result.
"""

import heapq
import itertools
from dataclasses import dataclass

from tierserve.config import SchedulerConfig
from tierserve.core.block_manager import BlockManager
from tierserve.core.clock import ManualClock
from tierserve.core.request import Request, Tier
from tierserve.core.scheduler import RunnerOutput, Scheduler, SchedulerOutput
from tierserve.core.step_time import StepTimeModel
from tierserve.engine.stats import RequestStats
from tierserve.errors import ConfigError
from tierserve.metering.cost import CostMeter
from tierserve.sim.workload import ClosedLoop, SimRequest

STEP_DONE, ARRIVAL = 0, 1
TOKEN = 1  # every simulated output token; EOS is ignored


@dataclass
class SimResult:
    requests: list[RequestStats]
    makespan_s: float
    busy_s: float
    num_steps: int
    preemptions_by_tier: dict
    recomputed_tokens_by_tier: dict
    mean_kv_usage: float
    meter: CostMeter
    """Its totals are the window's machine cost; each request's cost is on its stats."""


class Simulator:
    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int,
                 max_model_len: int, model: StepTimeModel, price_per_hour: float,
                 step_time_limit_s: float | None = None, enable_prefix_caching: bool = True,
                 reserved_fraction: float = 0.0, progress=None):
        config.validate()
        self.clock = ManualClock()
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching,
                                          evict_by_tier=config.policy == "tiered")
        self.scheduler = Scheduler(config, self.block_manager, max_model_len,
                                   step_time_model=model, step_time_limit_s=step_time_limit_s)
        self.model = model
        self.max_model_len = max_model_len
        self.meter = CostMeter(price_per_hour, work_model=model,
                               reserved_fraction=reserved_fraction)
        self.progress = progress
        self._events: list = []
        self._seq = itertools.count()
        self._stats: dict[str, RequestStats] = {}
        self._done: list[RequestStats] = []
        self._user_of: dict[str, int] = {}
        self._busy = False
        self._busy_s = 0.0
        self._kv_sum = 0.0
        self._num_steps = 0
        self._ids = itertools.count()

    # -------------------------------------------------------------- public
    def run(self, workload: list[SimRequest] | ClosedLoop) -> SimResult:
        closed = workload if isinstance(workload, ClosedLoop) else None
        if closed:
            self._queue = list(reversed(closed.requests))
            for user in range(min(closed.users, len(closed.requests))):
                self._push(0.0, ARRIVAL, (self._queue.pop(), user))
        else:
            for req in workload:
                self._push(req.arrival_s, ARRIVAL, (req, None))
        total = len(closed.requests) if closed else len(workload)
        while self._events:
            t, kind, _, payload = heapq.heappop(self._events)
            self.clock.set(t)
            if kind == ARRIVAL:
                self._arrive(*payload)
            else:
                done_before = len(self._done)
                self._complete(payload, closed)
                if self.progress and len(self._done) // 1000 > done_before // 1000:
                    self.progress(len(self._done), total)
            simultaneous = self._events and self._events[0][0] <= t
            if not self._busy and not simultaneous and self.scheduler.has_unfinished():
                self._start_step()
        self.meter.close_window(self.clock.now())
        first = min((s.arrival_time for s in self._done), default=0.0)
        return SimResult(
            requests=self._done, makespan_s=self.clock.now() - first, busy_s=self._busy_s,
            num_steps=self._num_steps,
            preemptions_by_tier=dict(self.scheduler.preemptions_by_tier),
            recomputed_tokens_by_tier=dict(self.scheduler.recomputed_tokens_by_tier),
            mean_kv_usage=self._kv_sum / max(self._num_steps, 1), meter=self.meter)

    # ------------------------------------------------------------- events
    def _push(self, t: float, kind: int, payload) -> None:
        heapq.heappush(self._events, (t, kind, next(self._seq), payload))

    def _arrive(self, req: SimRequest, user: int | None) -> None:
        i = next(self._ids)
        rid = f"sim-{i}"
        prompt_len = max(1, min(req.prompt_tokens, self.max_model_len - 1))
        output = max(1, min(req.output_tokens, self.max_model_len - prompt_len))
        prefix = min(req.shared_prefix, prompt_len - 1)
        # A unique token right after the shared prefix: no accidental prefix-cache hits.
        prompt = list(range(10, 10 + prefix)) + [100_000 + i] + [5] * (prompt_len - prefix - 1)
        now = self.clock.now()
        self.scheduler.add_request(Request(rid, prompt, output, arrival_time=now,
                                           ignore_eos=True, tier=Tier.parse(req.tier)))
        self._stats[rid] = RequestStats(rid, now, tier=req.tier, num_prompt_tokens=prompt_len)
        if user is not None:
            self._user_of[rid] = user

    def _start_step(self) -> None:
        now = self.clock.now()
        out = self.scheduler.schedule(now)
        for rid in out.refused_ids:
            self._finish(rid, "refused", now, None)
        if out.is_empty:
            if self.scheduler.has_unfinished() and not self._events:
                raise ConfigError("the simulated engine cannot run the waiting requests "
                                  "(KV pool too small for them?)")
            return
        seqs = [(len(s.token_ids), s.start_pos + len(s.token_ids)) for s in out.seqs]
        duration = self.model.predict_s(seqs)
        for s in out.seqs:
            stats = self._stats[s.request_id]
            if stats.first_scheduled_time is None:
                stats.first_scheduled_time = now
        self.meter.record_step(now, duration, [
            (s.request_id, n, ctx, s.is_decode) for s, (n, ctx) in zip(out.seqs, seqs)])
        self._busy = True
        self._busy_s += duration
        self._num_steps += 1
        self._push(now + duration, STEP_DONE, out)

    def _complete(self, out: SchedulerOutput, closed: ClosedLoop | None) -> None:
        self._busy = False
        now = self.clock.now()
        sampled = {s.request_id: TOKEN for s in out.seqs if s.sample}
        for request in self.scheduler.update(out, RunnerOutput(sampled)):
            stats = self._stats[request.request_id]
            if stats.first_token_time is None:
                stats.first_token_time = now
            stats.token_times.append(now)
            if request.is_finished:
                self._finish(request.request_id, request.status.finish_reason, now, request)
                user = self._user_of.pop(request.request_id, None)
                if closed and user is not None and self._queue:
                    self._push(now + closed.think_s, ARRIVAL, (self._queue.pop(), user))
        self._kv_sum += self.block_manager.usage

    def _finish(self, rid: str, reason: str, now: float, request: Request | None) -> None:
        stats = self._stats.pop(rid)
        stats.finished_time = now
        stats.finish_reason = reason
        if request is not None:
            stats.num_output_tokens = request.num_output_tokens
            stats.num_cached_tokens = max(request.num_cached_tokens, 0)
            stats.num_preemptions = request.num_preemptions
            stats.num_recomputed_tokens = request.num_recomputed_tokens
        self.meter.on_request_finished(stats)
        self._done.append(stats)

