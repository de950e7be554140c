"""The scheduler: which tokens of which requests run in the next engine step.

NOTE: the algorithm (schedule tokens, not phases)
    Each request has `num_computed_tokens` (KV in cache) and `num_tokens` (prompt plus
    output so far). A step hands out at most `max_num_batched_tokens` tokens to at most
    `max_num_seqs` requests so that each request's computed count catches up with its
    tokens: a whole prompt, a chunk of it, a recompute after preemption, or the single
    newest token (decode) are all the same thing.
      1. Running requests first, in policy order. Each asks for all its missing tokens
         (capped by the remaining budget). If the KV pool cannot hold them, the running
         request the policy ranks last is preempted (blocks freed, progress reset, back to
         the waiting queue under its original key) until the allocation fits, or the
         request itself was the victim.
      2. Then waiting requests, in policy order, while budget and slots remain and nothing
         was preempted this step. A waiting request first reuses its longest cached prefix.
    Preemption is by recompute: cheaper than swapping on a CPU and always possible; the
    recomputed tokens are counted as wasted work.
"""

import heapq
from dataclasses import dataclass, field

from tierserve.config import SchedulerConfig
from tierserve.core.block_manager import BlockManager
from tierserve.core.policy import FCFSPolicy, SchedulingPolicy
from tierserve.core.request import Request, RequestStatus


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


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for s in self.seqs if s.is_decode)

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


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 max_model_len: int, policy: SchedulingPolicy | None = None):
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.policy = policy or FCFSPolicy()
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self._waiting: list[tuple[tuple, Request]] = []  # heap by policy key
        self._num_waiting = 0
        self._arrivals = 0
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0

    # ----------------------------------------------------------- queue state
    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add_request(self, request: Request) -> None:
        request.arrival_seq = self._arrivals
        self._arrivals += 1
        self.requests[request.request_id] = request
        self._push_waiting(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request now (abort, stop string). Frees its blocks at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.is_finished:
            self._num_waiting -= 1  # stays in the heap; skipped when it surfaces
        request.status = status
        self.block_manager.free(request)
        return request

    # -------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        budget = self._schedule_running(budget, scheduled, preempted)
        if not preempted:
            self._schedule_waiting(budget, scheduled)
        return SchedulerOutput(
            seqs=[self._describe(req, n) for req, n in scheduled],
            preempted_ids=[r.request_id for r in preempted])

    def _schedule_running(self, budget: int, scheduled: list, preempted: list) -> int:
        self.running.sort(key=self.policy.key)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(request, num_new):
                victim = self.running.pop()  # ranked last by the policy
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                budget -= num_new
                i += 1
                continue
            break
        return budget

    def _schedule_waiting(self, budget: int, scheduled: list) -> None:
        bm = self.block_manager
        while self._num_waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self._peek_waiting()
            hit_blocks, num_hit = bm.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            if not bm.allocate_slots(request, num_new, hit_blocks):
                break
            self._pop_waiting()
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(request)

    def _describe(self, request: Request, num_new: int) -> ScheduledSeq:
        start = request.num_computed_tokens
        end = start + num_new
        return ScheduledSeq(
            request_id=request.request_id,
            token_ids=request.tokens_slice(start, end),
            start_pos=start,
            block_table=list(request.block_table),
            sample=end == request.num_tokens,
            is_decode=num_new == 1 and end == request.num_tokens
            and request.num_output_tokens > 0,
            num_output_tokens=request.num_output_tokens)

    # ---------------------------------------------------------------- update
    def update(self, output: SchedulerOutput, runner_output: RunnerOutput) -> list[Request]:
        """Apply a finished step. Returns the requests that got a token or finished."""
        touched = []
        for seq in output.seqs:
            request = self.requests.get(seq.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            n = len(seq.token_ids)
            recomputed = max(0, min(seq.start_pos + n, request.num_ever_computed) - seq.start_pos)
            request.num_recomputed_tokens += recomputed
            self.num_recomputed_tokens += recomputed
            request.num_computed_tokens += n
            request.num_ever_computed = max(request.num_ever_computed, request.num_computed_tokens)
            self.block_manager.cache_full_blocks(request)
            if seq.sample:
                request.output_token_ids.append(runner_output.sampled_token_ids[seq.request_id])
                status = self._check_stop(request)
                if status is not None:
                    self.finish_request(request.request_id, status)
                touched.append(request)
        return touched

    def _check_stop(self, request: Request) -> RequestStatus | None:
        token = request.output_token_ids[-1]
        if request.num_output_tokens >= request.min_tokens:
            if token == request.eos_token_id and not request.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in request.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # --------------------------------------------------------- waiting heap
    def _push_waiting(self, request: Request) -> None:
        heapq.heappush(self._waiting, (self.policy.key(request), request.arrival_seq, request))
        self._num_waiting += 1

    def _peek_waiting(self) -> Request:
        while self._waiting[0][-1].is_finished:
            heapq.heappop(self._waiting)
        return self._waiting[0][-1]

    def _pop_waiting(self) -> Request:
        request = self._peek_waiting()
        heapq.heappop(self._waiting)
        self._num_waiting -= 1
        return request
