"""The scheduler: which tokens of which requests run in the next engine step.

NOTE: the algorithm (schedule tokens, not phases)
    Each request has `num_computed_tokens` (KV in cache) and `num_tokens` (prompt plus
    output so far). A step hands out at most `max_num_batched_tokens` tokens to at most
    `max_num_seqs` requests so that each request's computed count catches up with its
    tokens: a whole prompt, a chunk of it, a recompute after preemption, or the single
    newest token (decode) are all the same thing.
      0. (tiered) Housekeeping by the clock: flex requests not started within
         `flex_max_wait_s` are refused; default requests waiting `default_aging_s` are
         promoted to priority's rank.
      1. Running requests first, in policy order. Each asks for all its missing tokens,
         capped by the remaining budget and (tiered, while a priority request decodes) by
         the step-time cap. If the KV pool cannot hold them, a running request of the same
         or a worse rank is preempted (blocks freed, progress reset, back to the waiting
         queue under its original key) until the allocation fits, or the request itself
         was the victim.
      2. Then waiting requests, in policy order, while budget and slots remain. After a
         preemption only priority-rank requests are admitted (anything else would take
         the room back). A waiting request first reuses its longest cached prefix.
         (tiered) A waiting priority request may preempt lower tiers for a slot and for
         blocks; other tiers must leave the reserved slots and blocks free.
    Preemption is by recompute: cheaper than swapping on a CPU and always possible; the
    recomputed tokens are counted, per tier, as wasted work.

NOTE: the step-time cap (tiered)
    While any priority request is in the engine (waiting, prefilling or decoding), the
    predicted time of the step (StepTimeModel) must stay within `step_time_limit_s`, divided
    by the smoothed ratio of measured to predicted time of recent steps whose prefill the
    cap sized (so model error does not leak into TPOT; decode-only steps, which it never
    cuts, do not count: their error differs, and with them in the ratio a 4-bit model's
    mixed steps ran up to 1.3x over). So priority's time per output token holds however much
    other work is queued. Priority sequences are never cut. A step that gives a priority
    request its first token carries no lower-tier work at all (so its TTFT is close to an
    idle engine's), but only every other step, so a stream of priority arrivals slows lower
    tiers by half at most. Other sequences are added in order while they fit; a prefill
    chunk is shortened to fit after setting aside the time of every decode not yet placed,
    so lower tiers' prefill is cut first and their decodes last. Without the cap, batch-tier
    prompts still get at most `batch_prefill_tokens` per step: a batch keeps every slot
    busy, and a priority request arriving then waits for one step of decodes, not a long
    prefill. With no priority request about (past the guard below), steps that carry
    anyone's decodes keep to a looser cap (`decode_time_limit_s`, 2.5 times the priority cap
    by default) by the same rules, so one long prompt's prefill chunks do not stall every
    stream in flight; where the decodes alone come near that cap, a step may take up to
    DECODE_CAP_FLOOR times their time, and where more default-tier prompts could start or
    are prefilling than streams decode, (1 + prompts / streams) times (a burst's prompts
    each get a stream's share). From a step where BURST_RATIO times as many prompts as
    streams could use it, until none is left, that cap is off: the burst is prefilled first
    at the token budget, the decodes in the same steps (tier_rules.BURST_RATIO says why).
    For `priority_guard_s` after the last priority request left (the guard), every step,
    with decodes or not, keeps to the decode cap by its rules, except that no burst lifts it
    and the prompts' share is at most BURST_RATIO streams' (2.5 priority caps where the
    decode cap is off): a priority arrival then waits for one step of bounded length before
    its own (tier_rules.StepCaps.limit_s says why not the priority cap).

Why one file of about 600 lines: budget, cap, slots, blocks and preemption decide together
within one pass over the queues (a preemption gives back budget and predicted time that
the next request may take), so they share the `_Step` state and read best side by side;
the step's update shares the queues and the block manager's invariants, checked together.
The policies (core/policy.py), the step-time model (core/step_time.py) and the tier rules
that do not depend on this scheduler's queues (core/tier_rules.py: which cap, its ratio
and floor, the rules by the clock, the victim), which the vLLM plugin applies too, live
apart.
"""

import heapq
from collections import Counter
from dataclasses import dataclass, field

from tierserve.config import SchedulerConfig, SpeculativeConfig
from tierserve.core.block_manager import BlockManager
from tierserve.core.fair import FairShare
from tierserve.core.policy import SchedulingPolicy, make_policy
from tierserve.core.request import Request, RequestStatus
from tierserve.core.speculate import NgramProposer
from tierserve.core.step_time import EPS_S, StepTimeModel
from tierserve.core.tier_rules import StepCaps, TierClock, victim
from tierserve.errors import ConfigError
from tierserve.tiers import Tier


@dataclass
class ScheduledSeq:
    """One request's share of a step, as the runner needs it."""

    request_id: str
    token_ids: list[int]
    """Tokens to compute, at positions start_pos ... start_pos + len - 1."""
    start_pos: int
    block_table: list[int]
    sample: bool
    """The chunk reaches the newest token, so the step samples the next one."""
    is_decode: bool
    num_output_tokens: int
    num_draft: int = 0
    """The last `num_draft` of token_ids are draft tokens to verify (a decode that
    speculates): every position is sampled, and the tokens kept run to the first one
    that differs from its draft."""


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    refused_ids: list[str] = field(default_factory=list)
    """Requests the scheduler ended without running them: flex past its wait limit
    (refused), or a prompt longer than its tier may hold (length)."""
    predicted_s: float | None = None
    """The step-time model's prediction for this step (None without a model)."""
    capped: bool = False
    """Whether a step-time cap was on and the step carries prefill tokens: the steps
    whose size the cap decides, and whose error it corrects (observe_step_time)."""

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def num_decode_tokens(self) -> int:
        """Tokens of decodes (a speculating decode counts its drafts)."""
        return sum(1 + s.num_draft for s in self.seqs if s.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_scheduled_tokens - self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass
class RunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    """Next token of every sequence whose ScheduledSeq had sample=True."""
    more_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Of a speculating decode: the verified tokens after the first, in order."""
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]] = field(default_factory=dict)
    """For requests that asked: the token's logprob and the top (token, logprob) pairs."""


@dataclass
class _Step:
    """What one `schedule()` call has handed out so far."""

    budget: int
    time_limit_s: float | None = None
    """Predicted-time cap of this step, or None."""
    time_s: float = 0.0
    pending_decode_s: float = 0.0
    """Predicted time of running decodes not yet placed (set aside under the cap)."""
    priority_starting: bool = False
    """A priority request waits for its first token: lower tiers sit this step out."""
    decodes_only_cap: bool = False
    """The cap is the decode cap's kind (no priority about: the decode cap, or the guard's):
    it shortens prefill chunks only."""
    burst: bool = False
    """A burst lifted the decode cap (StepCaps.floor_s): decodes are placed first."""
    batch_prefill: int = 0
    """Prompt tokens batch-tier requests may still compute this step."""
    scheduled: dict = field(default_factory=dict)
    """Request -> (num_new_tokens, predicted seconds), in scheduling order."""
    preempted: list = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 max_model_len: int, policy: SchedulingPolicy | None = None,
                 step_time_model: StepTimeModel | None = None,
                 step_time_limit_s: float | None = None,
                 speculative: SpeculativeConfig | None = None):
        """`step_time_model` and `step_time_limit_s` enable the tiered step-time cap;
        `speculative`, drafts by prompt lookup (core/speculate.py)."""
        self.config = config
        self.speculative = speculative
        self.proposer = NgramProposer(speculative) if speculative else None
        self._spec_tiers = {Tier.parse(t) for t in speculative.tiers} if speculative else set()
        self.num_draft_tokens: Counter[Tier] = Counter()
        self.num_accepted_tokens: Counter[Tier] = Counter()
        """Draft tokens verified and kept, per served tier (vLLM's spec_decode counters)."""
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.policy = policy or make_policy(config.policy)
        self.step_time_model = step_time_model
        self.step_time_limit_s = step_time_limit_s
        self.caps = StepCaps()
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self._waiting: list[tuple[tuple, int, Request]] = []  # heap by policy key
        self._num_waiting = 0
        self._waiting_default = 0  # of them, default-tier (the decode cap's floor reads it)
        self._arrivals = 0
        self._clock_rules = TierClock()  # flex and default in arrival order
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self.recomputed_tokens_by_tier: Counter[Tier] = Counter()
        self.preemptions_by_tier: Counter[Tier] = Counter()
        self._num_priority = 0  # priority-tier requests in the engine
        self.max_len_lower = max_model_len
        """Longest prompt + output of a lower-tier request: what the blocks outside the
        priority reserve hold (more could never be allocated: it would wait forever)."""
        if self.policy.tiered and config.reserved_priority_blocks:
            if config.reserved_priority_blocks >= block_manager.num_blocks:
                raise ConfigError(
                    f"reserved_priority_blocks {config.reserved_priority_blocks} leaves no KV "
                    f"block for the other tiers: the pool has {block_manager.num_blocks} "
                    "(give fewer, or more KV memory)")
            self.max_len_lower = min(max_model_len, block_manager.block_size * (
                block_manager.num_blocks - config.reserved_priority_blocks))
        self._too_long: list[Request] = []
        self.fair = FairShare()

    # ----------------------------------------------------------- queue state
    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def step_time_ratio(self) -> float:
        """Measured over predicted time of the steps the cap sized (core/tier_rules.py)."""
        return self.caps.ratio

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add_request(self, request: Request) -> None:
        request.arrival_seq = self._arrivals
        self._arrivals += 1
        request.fair_tag = self.fair.tag(int(request.tier), request.owner.tenant,
                                         request.owner.weight,
                                         request.num_prompt_tokens + request.max_tokens)
        self.requests[request.request_id] = request
        self._num_priority += request.tier == Tier.PRIORITY
        if request.num_prompt_tokens >= self.max_len(request.tier):
            self._too_long.append(request)  # waiting until the next schedule() ends it
            self._num_waiting += 1
            self._waiting_default += request.tier == Tier.DEFAULT
            return
        self._push_waiting(request)
        if self.policy.tiered:
            self._clock_rules.add(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request now (abort, stop string, refusal). Frees its blocks at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self._num_priority -= request.tier == Tier.PRIORITY
        self.fair.finished(int(request.tier), request.owner.tenant, request.owner.weight,
                           request.num_prompt_tokens + request.max_tokens - request.num_tokens)
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.is_finished:
            self._num_waiting -= 1  # stays in the heap; skipped when it surfaces
            self._waiting_default -= request.tier == Tier.DEFAULT
        request.status = status
        self.block_manager.free(request)
        if self.proposer is not None:
            self.proposer.forget(request_id)
        return request

    # -------------------------------------------------------------- schedule
    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        """Plan the next step; `now` (the engine's clock) drives aging and the flex limit."""
        refused = self._refuse_overdue_flex(now) if self.policy.tiered else []
        while self._too_long:
            request = self._too_long.pop()
            if self.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH):
                refused.append(request)
        if self.policy.tiered:
            self._age_default(now)
        step = _Step(self.config.max_num_batched_tokens)
        step.time_limit_s, step.decodes_only_cap = self._time_limit_s(now)
        step.batch_prefill = self.config.batch_prefill_tokens if self.policy.tiered else 0
        step.batch_prefill = step.batch_prefill or step.budget
        if step.time_limit_s is not None:
            step.time_s = self.step_time_model.fixed_s
            step.pending_decode_s = self._pending_decode_s()
            if step.decodes_only_cap:   # never below DECODE_CAP_FLOOR decode-only steps;
                step.time_limit_s = self.caps.floor_s(    # none through a burst
                    step.time_limit_s, step.time_s + step.pending_decode_s,
                    self._floor_prompts(), sum(map(self._is_decoding, self.running)),
                    now, self._floor_prompts)
                step.burst = step.time_limit_s is None
                step.decodes_only_cap = not step.burst
            step.priority_starting = self.caps.starting(self._num_priority > sum(
                r.tier == Tier.PRIORITY and r.num_output_tokens > 0 for r in self.running))
        self._schedule_running(step)
        self._schedule_waiting(step)
        out = SchedulerOutput(
            seqs=[self._describe(req, n) for req, (n, _) in step.scheduled.items()],
            preempted_ids=[r.request_id for r in step.preempted],
            refused_ids=[r.request_id for r in refused])
        if self.step_time_model is not None and out.seqs:
            out.predicted_s = self.step_time_model.predict_s(
                [(len(x.token_ids), x.start_pos + len(x.token_ids)) for x in out.seqs])
            out.capped = step.time_limit_s is not None and out.num_prefill_tokens > 0
        return out

    def observe_step_time(self, out: SchedulerOutput, measured_s: float) -> None:
        """Feed back a step's measured time (the engine calls this after each step). Only
        steps whose prefill the cap sized count: the model's error differs between
        decode-only steps and mixed ones (0.9-1.1 against up to 1.3 for a 4-bit model at
        16 and 64 streams), and the cap only ever cuts the mixed ones."""
        self.caps.observe(out.predicted_s, measured_s, out.capped)

    def _schedule_running(self, step: _Step) -> None:
        def decodes_first(r: Request) -> tuple:
            return not self._is_decoding(r), self.policy.key(r)

        # through a burst no cap leaves room for the decodes: they go first, so a prompt's
        # chunk sorted ahead of them cannot take the whole budget
        for request in sorted(self.running,
                              key=decodes_first if step.burst else self.policy.key):
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            want = request.num_tokens - request.num_computed_tokens
            drafts = self._drafts(request, step) if want == 1 else []
            num_new = self._fit(request, want + len(drafts), step)
            request.draft_token_ids = drafts[:max(num_new - want, 0)]
            if num_new and self._allocate(request, num_new, step):
                self._add(request, num_new, step)

    def _drafts(self, request: Request, step: _Step) -> list[int]:
        """Draft tokens for a running decode, where speculation may spend compute on it:
        its tier speculates, the batch is small (running and waiting requests together
        within disable_by_batch_size: a queue gets the room first), and a step-time
        cap, where one is on, never cuts its decode (priority, or the decode cap)."""
        spec = self.speculative
        if spec is None or not request.can_speculate or request.tier not in self._spec_tiers \
                or len(self.running) + self._num_waiting > spec.disable_by_batch_size \
                or not self._is_decoding(request):
            return []
        if step.time_limit_s is not None and request.tier != Tier.PRIORITY \
                and not step.decodes_only_cap:
            return []
        limit = min(request.max_tokens - request.num_output_tokens,
                    self.max_len(request.tier) - request.num_tokens) - 1
        return self.proposer.propose(request, limit)

    def _schedule_waiting(self, step: _Step) -> None:
        bm = self.block_manager
        cut: list[Request] = []  # top-rank requests the cap left out, set aside for this step
        while self._num_waiting and step.budget > 0:
            request = self._peek_waiting()
            top = self.policy.tiered and request.rank == Tier.PRIORITY
            if step.preempted and not top:
                break
            if not self._take_slot(request, step):
                break
            hit_blocks, num_hit = bm.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if not self.config.enable_chunked_prefill and num_new > step.budget:
                break
            num_new = self._fit(request, num_new, step, start=num_hit)
            if not num_new and top and request.tier != Tier.PRIORITY:
                cut.append(self._pop_waiting())  # an aged request: priority ones behind it
                continue                         # may still start
            if not num_new or not self._allocate(request, num_new, step, hit_blocks):
                break
            self._pop_waiting()
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
                self.fair.dispatched(int(request.tier), request.fair_tag)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add(request, num_new, step)
        for request in cut:
            self._push_waiting(request)

    # ------------------------------------------------- budget, cap, blocks
    @property
    def decode_time_limit_s(self) -> float | None:
        """The cap of steps that carry decodes while the priority cap is off."""
        return StepCaps.decode_limit_s(self.config, self.step_time_limit_s)

    def _time_limit_s(self, now: float) -> tuple[float | None, bool]:
        """This step's cap (model seconds) and whether it is the decode cap."""
        if not (self.policy.tiered and self.step_time_model and self.step_time_limit_s):
            return None, False
        return self.caps.limit_s(now, self.config, self.step_time_limit_s,
                                 self._num_priority > 0,
                                 any(map(self._is_decoding, self.running)))

    def _fit(self, request: Request, want: int, step: _Step, start: int | None = None) -> int:
        """How many of `want` tokens, computed from position `start` (default: what is
        computed), the request gets this step: the budget, then the cap."""
        num_new = min(want, step.budget)
        decoding = self._is_decoding(request)
        if request.tier == Tier.BATCH and not decoding and self.config.enable_chunked_prefill:
            num_new = min(num_new, step.batch_prefill)
        if step.time_limit_s is None or num_new <= 0:
            return max(num_new, 0)
        model = self.step_time_model
        start = request.num_computed_tokens if start is None else start
        if decoding:
            step.pending_decode_s -= self._decode_cost_s(request)
        if request.tier == Tier.PRIORITY or (decoding and step.decodes_only_cap):
            return num_new
        if step.priority_starting:
            return 0  # the step that gives a priority request its first token stays short
        room = step.time_limit_s - step.time_s
        if not decoding:
            room -= step.pending_decode_s  # cut prefill before anyone's decode
        if model.seq_cost_s(num_new, start + num_new) <= room + EPS_S:
            return num_new
        if decoding or not self.config.enable_chunked_prefill:
            return 0
        return model.max_tokens_within(room, start, num_new)

    def _add(self, request: Request, num_new: int, step: _Step) -> None:
        cost = 0.0
        if step.time_limit_s is not None:
            cost = self.step_time_model.seq_cost_s(
                num_new, request.num_computed_tokens + num_new)
        step.scheduled[request] = (num_new, cost)
        step.budget -= num_new
        if request.tier == Tier.BATCH and not self._is_decoding(request):
            step.batch_prefill -= num_new
        step.time_s += cost

    def _take_slot(self, request: Request, step: _Step) -> bool:
        """A sequence slot for a waiting request, preempting for it if the policy allows."""
        limit = self.max_seqs(request.tier)
        while len(self.running) >= limit:
            chosen = victim(self.policy, request, self.running, waiting=True)
            if chosen is None:
                return False
            self._preempt(chosen, step)
        return True

    def _allocate(self, request: Request, num_new: int, step: _Step,
                  hit_blocks: list[int] = ()) -> bool:
        """Blocks for `num_new` more tokens, preempting while the policy allows.
        False if they cannot be had (and the request itself may have been preempted)."""
        waiting = request.status != RequestStatus.RUNNING
        reserve = 0
        if self.policy.tiered and request.tier != Tier.PRIORITY:
            reserve = self.config.reserved_priority_blocks
        while not self.block_manager.allocate_slots(request, num_new, hit_blocks, reserve):
            chosen = victim(self.policy, request, self.running, waiting)
            if chosen is None:
                return False
            self._preempt(chosen, step)
            if chosen is request:
                return False
        return True

    def _preempt(self, request: Request, step: _Step) -> None:
        if request in step.scheduled:  # placed earlier in this step: give its share back
            num_new, cost = step.scheduled.pop(request)
            step.budget += num_new
            step.time_s -= cost
        self.running.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.draft_token_ids = []
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.preemptions_by_tier[request.tier] += 1
        self._push_waiting(request)
        step.preempted.append(request)

    @staticmethod
    def _is_decoding(request: Request) -> bool:
        out = request.output_token_ids  # (hot: no properties)
        return bool(out) and \
            len(request.prompt_token_ids) + len(out) - request.num_computed_tokens == 1

    def _pending_decode_s(self) -> float:
        """Predicted time of every running decode: the sum of their `_decode_cost_s`,
        in closed form (hot: once per capped step)."""
        num, context = 0, 0
        for r in self.running:
            out = r.output_token_ids
            if out:
                total = len(r.prompt_token_ids) + len(out)
                if total - r.num_computed_tokens == 1:
                    num += 1
                    context += total
        m = self.step_time_model
        return num * (m.per_seq_s + m.per_token_s) + m.per_kv_token_s * context

    def _floor_prompts(self, since: float | None = None) -> int:
        """Default-tier prompts that could use this step, for the cap's floor: those
        prefilling and those waiting that a free slot could start; of those that had
        arrived by `since` only, if given (a burst's: the queue is then read through)."""
        def counts(r: Request) -> bool:
            return r.tier == Tier.DEFAULT and (since is None or r.arrival_time <= since)

        prefilling = sum(not self._is_decoding(r) and counts(r) for r in self.running)
        waiting = self._waiting_default if since is None else len(
            {r.request_id for e in self._waiting if self._is_current(e) and counts(r := e[-1])})
        return self.caps.floor_prompts(prefilling, waiting, self.config.max_num_seqs,
                                       self.config.reserved_priority_seqs, len(self.running))

    def _decode_cost_s(self, request: Request) -> float:
        return self.step_time_model.seq_cost_s(1, request.num_tokens)

    # ------------------------------------------------ tiers by the clock
    def _refuse_overdue_flex(self, now: float) -> list[Request]:
        refused = self._clock_rules.overdue(now, self.config.flex_max_wait_s)
        for request in refused:
            self.finish_request(request.request_id, RequestStatus.FINISHED_REFUSED)
        return refused

    def _age_default(self, now: float) -> None:
        for request in self._clock_rules.aged(now, self.config.default_aging_s):
            self._push_waiting(request, again=True)  # the old heap entry goes stale

    def _describe(self, request: Request, num_new: int) -> ScheduledSeq:
        start = request.num_computed_tokens
        drafts = request.draft_token_ids
        end = start + num_new - len(drafts)
        num_output = len(request.output_token_ids)
        sample = end == len(request.prompt_token_ids) + num_output
        return ScheduledSeq(
            request_id=request.request_id,
            token_ids=request.tokens_slice(start, end) + drafts,
            start_pos=start,
            block_table=list(request.block_table),
            sample=sample,
            is_decode=num_new == 1 + len(drafts) and sample and num_output > 0,
            num_output_tokens=num_output,
            num_draft=len(drafts))

    # ---------------------------------------------------------------- update
    def update(self, output: SchedulerOutput, runner_output: RunnerOutput) -> list[Request]:
        """Apply a finished step. Returns the requests that got a token or finished."""
        touched = []
        for seq in output.seqs:
            request = self.requests.get(seq.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            n = len(seq.token_ids)
            tokens = [runner_output.sampled_token_ids[seq.request_id]] if seq.sample else []
            if seq.num_draft:    # the positions up to the first token off its draft count
                tokens += runner_output.more_token_ids.get(seq.request_id, [])
                n = len(tokens)
                self.num_draft_tokens[request.tier] += seq.num_draft
                self.num_accepted_tokens[request.tier] += n - 1
                request.num_draft_tokens += seq.num_draft
                request.num_accepted_tokens += n - 1
                request.draft_token_ids = []
            recomputed = max(0, min(seq.start_pos + n, request.num_ever_computed) - seq.start_pos)
            request.num_recomputed_tokens += recomputed
            self.num_recomputed_tokens += recomputed
            if recomputed:
                self.recomputed_tokens_by_tier[request.tier] += recomputed
            request.num_computed_tokens += n
            request.num_ever_computed = max(request.num_ever_computed, request.num_computed_tokens)
            self.block_manager.cache_full_blocks(request)
            for token in tokens:
                request.output_token_ids.append(token)
                status = self._check_stop(request)
                if status is not None:
                    self.finish_request(request.request_id, status)
                    break
            if tokens:
                touched.append(request)
        return touched

    def max_len(self, tier: Tier) -> int:
        """Longest prompt + output a request served in `tier` may reach in this engine."""
        return self.max_model_len if tier == Tier.PRIORITY else self.max_len_lower

    def max_seqs(self, tier: Tier) -> int:
        """Sequences of `tier` that may run at once: under the tiered policy the priority
        reserve's slots are not the lower tiers'."""
        if self.policy.tiered and tier != Tier.PRIORITY:
            return self.config.max_num_seqs - self.config.reserved_priority_seqs
        return self.config.max_num_seqs

    def _check_stop(self, request: Request) -> RequestStatus | None:
        token = request.output_token_ids[-1]
        num_output = len(request.output_token_ids)
        if num_output >= request.min_tokens:
            if token == request.eos_token_id and not request.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in request.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_output >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if len(request.prompt_token_ids) + num_output >= self.max_len(request.tier):
            return RequestStatus.FINISHED_LENGTH
        return None

    # --------------------------------------------------------- waiting heap
    def _push_waiting(self, request: Request, again: bool = False) -> None:
        """Queue under the policy's key; `again`: re-key a request already counted."""
        heapq.heappush(self._waiting, (self.policy.key(request), request.arrival_seq, request))
        self._num_waiting += not again
        self._waiting_default += not again and request.tier == Tier.DEFAULT

    def _peek_waiting(self) -> Request:
        while not self._is_current(self._waiting[0]):
            heapq.heappop(self._waiting)
        return self._waiting[0][-1]

    def _is_current(self, entry: tuple) -> bool:
        """Lazy deletion: entries of finished, running or re-keyed requests are stale."""
        key, _, request = entry
        return request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) \
            and key == self.policy.key(request)

    def _pop_waiting(self) -> Request:
        request = self._peek_waiting()
        heapq.heappop(self._waiting)
        self._num_waiting -= 1
        self._waiting_default -= request.tier == Tier.DEFAULT
        return request
