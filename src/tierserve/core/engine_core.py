"""EngineCore: one engine step without the model, shared by the engine and its twin.

NOTE: who does what
    The core owns the scheduler, the block manager and the request accounting
    (core/accounting.py: each request's `RequestStats`, the metering, the sinks; the same
    accounting fleet mode uses for remote replicas). A step is: `plan(now)` (the
    scheduler's choice; flex requests past their wait are finished as refused), then
    whoever runs the step (the model runner in `LLMEngine`, a step-time model in the
    simulator) hands back a `RunnerOutput`, and `apply(...)` does the bookkeeping: the
    scheduler's update, first-scheduled and token times, the step's `StepStats`, and the
    measured/predicted step-time ratio. Finished requests go through `finish()`: the
    accounting completes their stats, metering prices them (its `Bill` lands on the
    stats) and then every sink sees them. The engine and the simulator differ only in
    what runs the step and how time passes, so the twin cannot drift from the engine's
    bookkeeping.
"""

from tierserve.config import SchedulerConfig, SpeculativeConfig
from tierserve.core.accounting import Accounting
from tierserve.core.block_manager import BlockManager
from tierserve.core.policy import make_policy
from tierserve.core.request import Request, RequestStatus
from tierserve.core.scheduler import RunnerOutput, Scheduler, SchedulerOutput
from tierserve.core.stats import RequestStats, SeqStepStats, StepStats
from tierserve.core.step_time import StepTimeModel
from tierserve.tiers import Tier


class EngineCore:
    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int,
                 max_model_len: int, enable_prefix_caching: bool = True,
                 step_time_model: StepTimeModel | None = None,
                 step_time_limit_s: float | None = None,
                 speculative: SpeculativeConfig | None = None):
        config.validate()
        self.policy = make_policy(config.policy)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching,
                                          evict_by_tier=self.policy.tiered)
        self.scheduler = Scheduler(config, self.block_manager, max_model_len, self.policy,
                                   step_time_model=step_time_model,
                                   step_time_limit_s=step_time_limit_s,
                                   speculative=speculative)
        self.max_model_len = max_model_len
        self.accounting = Accounting()
        self._requests: dict[str, Request] = {}
        self.num_steps = 0
        self._busy_end: float | None = None
        """The last step's end where requests were left then (StepStats.follows)."""
        self.tier_map: dict[Tier, Tier] = {t: self.policy.served_tier(t) for t in Tier}
        """Tier asked for -> the tier it is served and billed in (fixed per policy)."""

    def dedicate(self, tier: Tier) -> None:
        """Serve one tier only (a dedicated fast lane): every request it takes is served
        and billed in `tier`, whatever its policy. Set up before the first request."""
        self.tier_map = {t: tier for t in Tier}

    # --------------------------------------------------------------- requests
    def add(self, request: Request, asked: Tier | None = None) -> RequestStats:
        """Queue a request whose tier is already the served one (`asked`: the tier it
        asked for, if another); its stats start here."""
        stats = self.accounting.start(request.request_id, request.arrival_time,
                                      request.tier if asked is None else asked,
                                      request.tier, request.num_prompt_tokens)
        self._requests[request.request_id] = request
        self.scheduler.add_request(request)
        return stats

    def end(self, request_id: str, status: RequestStatus) -> Request | None:
        """End an unfinished request now (abort, a matched stop string); its KV blocks
        return to the pool. Call `finish()` with it to account it."""
        return self.scheduler.finish_request(request_id, status)

    def finish(self, request: Request, now: float) -> RequestStats:
        """Account a finished request: complete its stats, price it, tell the sinks."""
        del self._requests[request.request_id]
        return self.accounting.finish(
            request.request_id, now, request.status.finish_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_output_tokens=request.num_output_tokens,
            num_preemptions=request.num_preemptions,
            num_recomputed_tokens=request.num_recomputed_tokens,
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_tokens=request.num_accepted_tokens)

    # ------------------------------------------------------------------- step
    def plan(self, now: float) -> tuple[SchedulerOutput, list[Request]]:
        """The next step, and the requests the scheduler refused (already finished in the
        scheduler: pass each to `finish()`)."""
        out = self.scheduler.schedule(now)
        refused = [self._requests[rid] for rid in out.refused_ids]
        return out, refused

    def begin(self, start: float) -> None:
        """A planned step starts running now (metering stops accruing idle time)."""
        self.accounting.step_starting(start)

    def apply(self, out: SchedulerOutput, result: RunnerOutput, start: float, end: float,
              measured_s: float | None = None) -> list[Request]:
        """Book a step that ran from `start` to `end`: the requests it touched (a new
        token, or finished; finished ones still need `finish()`). `measured_s`: the
        whole step as a token's wait sees it (default end - start), fed to the cap."""
        accounting = self.accounting
        for s in out.seqs:
            stats = accounting.stats.get(s.request_id)
            if stats is not None and stats.first_scheduled_time is None:
                accounting.scheduled(stats, start)
        touched = self.scheduler.update(out, result)
        for request in touched:
            stats = accounting.stats[request.request_id]
            accounting.tokens(stats, request.num_output_tokens - len(stats.token_times), end)
        self._record_step(out, start, end)
        self.scheduler.observe_step_time(out, end - start if measured_s is None else measured_s)
        return touched

    def _record_step(self, out: SchedulerOutput, start: float, end: float) -> None:
        stats = StepStats(
            step_index=self.num_steps, start_time=start, duration_s=end - start,
            num_seqs=len(out.seqs), num_prefill_tokens=out.num_prefill_tokens,
            num_decode_tokens=out.num_decode_tokens, num_preempted=len(out.preempted_ids),
            kv_usage=self.block_manager.usage, num_waiting=self.scheduler.num_waiting,
            seqs=[SeqStepStats(s.request_id, len(s.token_ids), s.start_pos + len(s.token_ids),
                               s.is_decode) for s in out.seqs],
            follows=self._busy_end)
        self._busy_end = end if self.scheduler.has_unfinished() else None
        self.num_steps += 1
        self.accounting.step(stats)
