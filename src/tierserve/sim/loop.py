"""The simulator's event loop: the production scheduler, block manager and cost meter,
driven by a manual clock and a step-time model instead of a model runner. One engine, or
a fleet of replicas behind a router (sim/fleet.py builds those).

NOTE: the loop
    Events sit in one heap ordered by (time, kind, sequence number), so equal times resolve
    the same way every run: a step's completion first, then arrivals. An arrival goes to
    the replica the router picks at that instant (one replica: always it). Processing an
    event never starts a step directly; once every event of the current instant is
    processed, each replica (in index order) with no step in flight and work to do plans
    its next step (`Scheduler.schedule`, exactly as the engine does), its duration
    predicted by the step-time model, and its completion pushed. A completion applies the
    step (`Scheduler.update`): requests get their token (a fixed token id; outputs run to
    their workload length with EOS ignored), finished ones are recorded, and closed-loop
    users send their next request. The replicas share the clock and nothing else. Same
    seed, same events, same result.

    A replica with work that plans an empty step while nothing else is pending would stall
    the clock; what can unblock it is time (the tiered caps stay on for `priority_guard_s`
    after the last priority request, and a sequence dearer than the guard's cap allows
    waits it out), so it gets one wake-up event that much later, as the engine would idle
    until then. Stalled again after that, the run stops with an error.
"""

import heapq
import itertools
from collections import Counter
from dataclasses import dataclass, field

from tierserve.config import SchedulerConfig
from tierserve.core.accounting import Accounting
from tierserve.core.block_manager import BlockManager
from tierserve.core.clock import ManualClock
from tierserve.core.engine_core import EngineCore
from tierserve.core.request import NO_OWNER, Owner, Request
from tierserve.core.scheduler import RunnerOutput, Scheduler, SchedulerOutput
from tierserve.core.stats import RequestStats
from tierserve.core.step_time import StepTimeModel, check_way_in
from tierserve.errors import ConfigError
from tierserve.metering.cost import CostMeter
from tierserve.router.flow import FlowConfig, Gateway, Pending, ReplicaState, prefix_keys
from tierserve.sim.workload import ClosedLoop, SimRequest
from tierserve.tiers import Tier

STEP_DONE, ARRIVAL, WAKE, REACH = 0, 1, 2, 3
WAKE_SLACK_S = 1e-6  # wake just after the guard has run out
TOKEN = 1  # every simulated output token; EOS is ignored


@dataclass
class ReplicaResult:
    name: str
    busy_s: float
    num_steps: int
    mean_kv_usage: float
    meter: CostMeter
    request_ids: list[str]
    """The requests this replica served, in arrival order."""


@dataclass
class SimResult:
    requests: list[RequestStats]
    makespan_s: float
    busy_s: float
    """Summed over replicas."""
    num_steps: int
    preemptions_by_tier: dict
    recomputed_tokens_by_tier: dict
    mean_kv_usage: float
    meter: CostMeter
    """Its totals are the window's machine cost (a fleet's: summed over replicas); each
    request's cost is on its stats."""
    replicas: list[ReplicaResult] = field(default_factory=list)


class Replica:
    """One engine: the engine's own core (scheduler, block manager, step bookkeeping) with
    a cost meter as its metering, its step in flight, and what a router reads (the tiers
    it takes, its outstanding tokens)."""

    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int,
                 max_model_len: int, model: StepTimeModel, price_per_hour: float,
                 step_time_limit_s: float | None = None, enable_prefix_caching: bool = True,
                 reserved_fraction: float = 0.0, name: str = "r0",
                 tiers: frozenset[str] | None = None, plan_model: StepTimeModel | None = None,
                 way_in_s: float = 0.0):
        """`model` gives each step's duration; `plan_model` (default: `model`) is what the
        scheduler plans with and the cost meter splits by, as an engine's calibration is.
        Given apart (an engine's forward-pass model beside a whole-step one), the
        scheduler learns their measured/predicted ratio as the engine's does.
        `way_in_s`: what a request spends outside the steps (HTTP in and out, tokenizing,
        streaming; `tierserve calibrate --backend URL --from-steps` measures it): a
        request sent to this replica reaches its scheduler that much later, so its TTFT
        and end-to-end time hold it, its TPOT not."""
        plan_model = plan_model or model
        self.name = name
        self.way_in_s = check_way_in(way_in_s, "way_in_s")
        self.tiers = tiers
        """Tiers a router may send here; None: every tier."""
        self.core = EngineCore(config, num_blocks, block_size, max_model_len,
                               enable_prefix_caching, step_time_model=plan_model,
                               step_time_limit_s=step_time_limit_s)
        self.scheduler, self.block_manager = self.core.scheduler, self.core.block_manager
        self.model = model
        self.same_model = plan_model is model
        self.max_model_len = max_model_len
        self.meter = CostMeter(price_per_hour, work_model=plan_model,
                               reserved_fraction=reserved_fraction)
        self.core.accounting.metering = self.meter
        if tiers is not None and len(tiers) == 1:
            self.core.dedicate(Tier.parse(next(iter(tiers))))
        self.busy = False
        self.stalled = False
        """It planned an empty step with work waiting and got a wake-up event."""
        self.busy_s = 0.0
        self.kv_sum = 0.0
        self.num_steps = 0
        self.request_ids: list[str] = []
        self._open_tokens = 0  # sum of prompt + output over unfinished, less outputs made
        self._tokens_of: dict[str, int] = {}

    def serves(self, tier: str) -> bool:
        return self.tiers is None or tier in self.tiers

    @property
    def outstanding_tokens(self) -> int:
        """Prompt tokens not yet computed plus output tokens not yet generated, over this
        replica's unfinished requests. Only running requests have computed prompt tokens
        (a preempted one starts over), so this walks at most max_num_seqs of them."""
        prefilled = sum(min(r.num_computed_tokens, r.num_prompt_tokens)
                        for r in self.scheduler.running)
        return self._open_tokens - prefilled

    def send(self, request: Request) -> None:
        """`request` is on its way here: a router counts it from now on, while the
        scheduler gets it after the way in (`add`)."""
        self.request_ids.append(request.request_id)
        self._tokens_of[request.request_id] = request.num_prompt_tokens + request.max_tokens
        self._open_tokens += request.num_prompt_tokens + request.max_tokens

    def add(self, request: Request, asked: Tier | None = None) -> RequestStats:
        """The scheduler has `request` (sent here before, or now)."""
        if request.request_id not in self._tokens_of:
            self.send(request)
        return self.core.add(request, asked)

    def forget(self, request_id: str, num_output_tokens: int) -> None:
        """A request finished: it no longer counts as outstanding."""
        self._open_tokens -= self._tokens_of.pop(request_id) - num_output_tokens


class Simulator:
    """One engine (this constructor) or a fleet of replicas (`Simulator.fleet`)."""

    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int,
                 max_model_len: int, model: StepTimeModel, price_per_hour: float,
                 step_time_limit_s: float | None = None, enable_prefix_caching: bool = True,
                 reserved_fraction: float = 0.0, progress=None,
                 plan_model: StepTimeModel | None = None, way_in_s: float = 0.0):
        self._setup([Replica(config, num_blocks, block_size, max_model_len, model,
                             price_per_hour, step_time_limit_s, enable_prefix_caching,
                             reserved_fraction, plan_model=plan_model, way_in_s=way_in_s)],
                    None, progress)

    @classmethod
    def fleet(cls, replicas: list[Replica], router, progress=None,
              gateway: FlowConfig | None = None) -> "Simulator":
        """`router(tier, replicas) -> index` picks each arrival's replica; with `gateway`
        instead, fleet mode's gateway (router/flow.py, the code the server runs) queues
        arrivals by tier and releases them to replicas."""
        if not replicas:
            raise ConfigError("a fleet needs at least one replica")
        sim = cls.__new__(cls)
        sim._setup(replicas, router, progress)
        if gateway is not None:
            states = [ReplicaState(r.name, r.scheduler.config.max_num_seqs,
                                   frozenset(r.tiers) if r.tiers else None) for r in replicas]
            sim.gateway = Gateway(states, gateway)
            sim._by_name = {r.name: r for r in replicas}
        return sim

    def _setup(self, replicas: list[Replica], router, progress) -> None:
        self.replicas = replicas
        self.router = router
        self.gateway: Gateway | None = None
        self._held: dict[str, tuple[Request, Tier, Pending]] = {}
        """Requests the gateway holds or has sent: what a replica gets, and its Pending."""
        self._gateway_accounting = Accounting()
        """Requests the gateway refused (they reach no replica), as fleet mode's are."""
        self._changed = False
        self._closed: ClosedLoop | None = None
        self.progress = progress
        """Called as progress(done, total) whenever requests finish."""
        self.clock = ManualClock()
        self._events: list = []
        self._seq = itertools.count()
        self._done: list[RequestStats] = []
        self._user_of: dict[str, int] = {}
        self._ids = itertools.count()

    # The single engine's parts (a fleet's first replica).
    @property
    def scheduler(self) -> Scheduler:
        return self.replicas[0].scheduler

    @property
    def block_manager(self) -> BlockManager:
        return self.replicas[0].block_manager

    @property
    def meter(self) -> CostMeter:
        return self.replicas[0].meter

    # -------------------------------------------------------------- public
    def run(self, workload: list[SimRequest] | ClosedLoop) -> SimResult:
        self._closed = closed = workload if isinstance(workload, ClosedLoop) else None
        if closed:
            self._queue = list(reversed(closed.requests))
            for user in range(min(closed.users, len(closed.requests))):
                self._push(0.0, ARRIVAL, (self._queue.pop(), user))
        else:
            for req in workload:
                self._push(req.arrival_s, ARRIVAL, (req, None))
        total = len(closed.requests) if closed else len(workload)
        start = self._events[0][0] if self._events else 0.0
        for replica in self.replicas:  # each is paid for from the first arrival on
            replica.meter.close_window(start)
        while self._events:
            t, kind, _, payload = heapq.heappop(self._events)
            self.clock.set(t)
            if kind == ARRIVAL:
                self._arrive(*payload)
            elif kind == REACH:
                self._reach(*payload)
            elif kind == STEP_DONE:
                done_before = len(self._done)
                self._complete(*payload)
                if self.progress and len(self._done) > done_before:
                    self.progress(len(self._done), total)
            if self._events and self._events[0][0] <= t:
                continue  # more of this instant first
            if self.gateway is not None and self._changed:
                self._release()
            for replica in self.replicas:
                if not replica.busy and replica.scheduler.has_unfinished():
                    self._start_step(replica)
        return self._result()

    # ------------------------------------------------------------- events
    def _push(self, t: float, kind: int, payload) -> None:
        heapq.heappush(self._events, (t, kind, next(self._seq), payload))

    def _arrive(self, req: SimRequest, user: int | None) -> None:
        i = next(self._ids)
        rid = f"sim-{i}"
        max_len = self.replicas[0].max_model_len
        if req.prompt_ids:
            prompt = list(req.prompt_ids[:max_len - 1])
            prompt_len = len(prompt)
        else:
            prompt_len = max(1, min(req.prompt_tokens, max_len - 1))
            prefix = min(req.shared_prefix, prompt_len - 1)
            # A unique token right after the shared prefix: no accidental prefix-cache hits.
            prompt = (list(range(10, 10 + prefix)) + [100_000 + i]
                      + [5] * (prompt_len - prefix - 1))
        output = max(1, min(req.output_tokens, max_len - prompt_len))
        now = self.clock.now()
        asked = Tier.parse(req.tier)
        owner = Owner(req.tenant, req.weight) if req.tenant else NO_OWNER
        request = Request(rid, prompt, output, arrival_time=now, ignore_eos=True, tier=asked,
                          owner=owner)
        if user is not None:
            self._user_of[rid] = user
        if self.gateway is not None:
            pending = Pending(rid, asked, prompt_len, output, now, prefix_keys(prompt),
                              tenant=owner.tenant, weight=owner.weight)
            self._held[rid] = (request, asked, pending)
            self.gateway.submit(pending)
            self._changed = True
            return
        replica = self.replicas[self.router(req.tier, self.replicas) if self.router else 0]
        self._admit(replica, request, asked)

    def _admit(self, replica: Replica, request: Request, asked: Tier) -> None:
        """`request` is sent to `replica` (a router counts it at once): its scheduler has
        it after the way in."""
        if replica.way_in_s:
            replica.send(request)
            self._push(self.clock.now() + replica.way_in_s, REACH, (replica, request, asked))
        else:
            self._reach(replica, request, asked)

    def _reach(self, replica: Replica, request: Request, asked: Tier) -> None:
        request.tier = replica.core.tier_map[asked]
        replica.add(request, asked)

    def _release(self) -> None:
        """Fleet mode's gateway at this instant: what it releases goes to its replica."""
        self._changed = False
        now = self.clock.now()
        for state in self.gateway.replicas:
            replica = self._by_name[state.name]
            state.kv_usage = replica.block_manager.usage
            state.num_waiting = replica.scheduler.num_waiting
        released, refused = self.gateway.release(now)
        for pending, state in released:
            request, asked, _ = self._held[pending.request_id]
            self._admit(self._by_name[state.name], request, asked)
        for pending in refused:  # never reached a replica
            request, asked, _ = self._held.pop(pending.request_id)
            self._gateway_accounting.start(request.request_id, request.arrival_time, asked,
                                           asked, request.num_prompt_tokens)
            self._done.append(self._gateway_accounting.finish(request.request_id, now,
                                                              "refused"))
            self._next_of_user(request.request_id, now)

    def _start_step(self, replica: Replica) -> None:
        now = self.clock.now()
        out, refused = replica.core.plan(now)
        for request in refused:  # a 429: a closed-loop user sends its next one too
            self._finish(replica, request, now)
        if out.is_empty:
            if replica.scheduler.has_unfinished() and not self._events:
                guard_s = replica.scheduler.config.priority_guard_s
                if replica.stalled or not guard_s:
                    raise ConfigError("the simulated engine cannot run the waiting requests "
                                      "(KV pool too small for them?)")
                replica.stalled = True
                self._push(now + guard_s + WAKE_SLACK_S, WAKE, replica)
            return
        replica.stalled = False
        seqs = [(len(s.token_ids), s.start_pos + len(s.token_ids)) for s in out.seqs]
        if replica.same_model and out.predicted_s is not None:
            duration = out.predicted_s  # the scheduler's own prediction
        else:
            duration = replica.model.predict_s(seqs)
        replica.busy = True
        replica.busy_s += duration
        replica.num_steps += 1
        self._push(now + duration, STEP_DONE, (replica, out, now, duration))

    def _complete(self, replica: Replica, out: SchedulerOutput, start: float,
                  duration: float) -> None:
        replica.busy = False
        now = self.clock.now()
        sampled = {s.request_id: TOKEN for s in out.seqs if s.sample}
        # The engine's bookkeeping; a step timed by the plan model itself teaches the cap
        # nothing (measured == predicted), as in the engine before this reshaping.
        touched = replica.core.apply(out, RunnerOutput(sampled), start, now,
                                     measured_s=duration)
        for request in touched:
            held = self._held.get(request.request_id) if self.gateway else None
            if held is not None and request.num_output_tokens == 1:
                self.gateway.first_token(held[2], now)
                self._changed = True
            if request.is_finished:
                self._finish(replica, request, now)
        replica.kv_sum += replica.block_manager.usage

    def _next_of_user(self, rid: str, now: float) -> None:
        """A closed-loop user whose request ended sends its next one."""
        closed = self._closed
        user = self._user_of.pop(rid, None)
        if closed and user is not None and self._queue:
            self._push(now + closed.think_s, ARRIVAL, (self._queue.pop(), user))

    def _finish(self, replica: Replica, request: Request, now: float) -> None:
        stats = replica.core.finish(request, now)
        replica.forget(request.request_id, stats.num_output_tokens)
        self._done.append(stats)
        held = self._held.pop(request.request_id, None) if self.gateway else None
        if held is not None:
            self.gateway.finished(held[2], now, stats.ttft_s, stats.tpot_s)
            self._changed = True
        self._next_of_user(request.request_id, now)

    # ------------------------------------------------------------- result
    def _result(self) -> SimResult:
        now = self.clock.now()
        parts = []
        for r in self.replicas:
            r.meter.close_window(now)
            parts.append(ReplicaResult(r.name, r.busy_s, r.num_steps,
                                       r.kv_sum / max(r.num_steps, 1), r.meter, r.request_ids))
        meter = self.replicas[0].meter
        if len(self.replicas) > 1:
            meter = CostMeter(sum(r.meter.price_per_hour for r in self.replicas))
            for name in ("machine_cost", "idle_cost", "reserved_idle_cost"):
                setattr(meter, name, sum(getattr(r.meter, name) for r in self.replicas))
        first = min((s.arrival_time for s in self._done), default=0.0)
        return SimResult(
            requests=self._done, makespan_s=now - first,
            busy_s=sum(p.busy_s for p in parts), num_steps=sum(p.num_steps for p in parts),
            preemptions_by_tier=dict(sum((r.scheduler.preemptions_by_tier
                                          for r in self.replicas), Counter())),
            recomputed_tokens_by_tier=dict(sum((r.scheduler.recomputed_tokens_by_tier
                                                for r in self.replicas), Counter())),
            mean_kv_usage=sum(p.mean_kv_usage for p in parts) / len(parts), meter=meter,
            replicas=parts)
