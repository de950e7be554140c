"""What the plugin measures and bills, apart from vLLM (so it is tested without it).

NOTE: a step's time, as the replica runs it
    vLLM's async scheduling queues the next step while one runs, so a step's time is
    measured from the later of its scheduling and the previous step's output to its own
    output: `sent(step)` when `schedule()` returns it, `done(step)` when
    `update_from_output` gets it. Steps are split in the order they come back, each
    after the one before, so the intervals never overlap and the time between them
    (nothing in flight) is idle.

NOTE: the model and the bill
    The measured steps (their (tokens, context) per sequence) refit a StepTimeModel
    (core/step_time.py, relative error) every FIT_EVERY steps once MIN_FIT_STEPS are in:
    the scheduler's cap predicts with it, and the cost meter (metering/cost.py) splits
    each step's measured cost by its work terms, through the request accounting
    (core/accounting.py). So requests + idle = the replica's machine cost, as in the
    engine. A step that followed the one before back to back (requests were left when
    that one came back: `left()`) says so (`StepStats.follows`), so the replica's step
    log (core/step_log.py, GET /tierserve/v1/steps) times it as a tierserve server's:
    from the end of the step before, vLLM's turn between steps included (a step after
    idle from its own start). The meter counts machine seconds (a price of one per
    second), which the book turns into USD at the replica's price and a gateway at its
    own. A finished request's bill goes to the CostBook under its gateway key.
"""

import time
from collections import deque
from dataclasses import asdict, dataclass

from tierserve.core.accounting import Accounting
from tierserve.core.stats import SeqStepStats, StepStats
from tierserve.core.step_time import StepTimeModel
from tierserve.errors import ConfigError
from tierserve.metering.cost import CostMeter
from tierserve.tiers import Tier
from tierserve.vllm.costs import CostBook

MIN_FIT_STEPS = 64
"""Measured steps before the first step-time model (and with it the cap)."""
FIT_EVERY = 256
"""Refit after this many more measured steps (a fit of FIT_WINDOW steps takes a few ms of
the engine core's thread)."""
FIT_WINDOW = 512
"""The newest steps a fit uses."""


@dataclass
class Sent:
    """A scheduled step, until its output is back."""

    at: float
    seqs: list[tuple[str, int, int, bool]]
    """(request id, tokens, context after the step, is decode)."""
    predicted_s: float | None
    capped: bool


class StepMeter:
    def __init__(self, price_per_hour: float, book: CostBook, clock=time.monotonic):
        self.clock = clock
        self.book = book
        self.price_per_s = price_per_hour / 3600
        self.meter = CostMeter(3600.0)  # machine seconds
        self.accounting = Accounting()
        self.accounting.metering = self.meter
        self.model: StepTimeModel | None = None
        self._samples: deque = deque(maxlen=FIT_WINDOW)
        self._since_fit = 0
        self._sent: dict = {}
        self._last_done: float | None = None
        self._busy_end: float | None = None
        """The last step's end where the engine still had requests then (left())."""
        self._keys: dict[str, tuple[str, str]] = {}  # request id -> (cost key, tenant)
        self._ending: dict[str, tuple] = {}  # ended, billed when its last step is back
        start = clock()  # the machine is paid from now: idle until the first step
        self.meter.close_window(start)
        self._booked_at = start
        """Up to when the meter has booked time (the last step's end)."""
        book.set_machine(0.0, 0.0, start, busy=False)

    @property
    def in_flight(self) -> bool:
        """A step was sent whose output is not back yet."""
        return bool(self._sent)

    # ------------------------------------------------------------- requests
    def start(self, request_id: str, tier: Tier, key: str, tenant: str,
              num_prompt_tokens: int, now: float) -> None:
        self._keys[request_id] = (key, tenant)
        self.accounting.start(request_id, now, tier, tier, num_prompt_tokens)

    def scheduled(self, request_id: str, now: float) -> None:
        stats = self.accounting.stats.get(request_id)
        if stats is not None:
            self.accounting.scheduled(stats, now)

    def tokens(self, request_id: str, n: int, now: float) -> None:
        stats = self.accounting.stats.get(request_id)
        if stats is not None:
            self.accounting.tokens(stats, n, now)

    def finish(self, request_id: str, now: float, reason: str, recomputed: int = 0,
               cached: int = 0, preemptions: int = 0) -> int:
        """The request ended: billed now, or, while a step with it is still in flight (an
        abort, or a step vLLM's async scheduling sent past the request's last token),
        once that step is back and split. The output tokens it was seen to make."""
        stats = self.accounting.stats.get(request_id)
        if stats is None:
            return 0
        made = len(stats.token_times)
        if any(rid == request_id for sent in self._sent.values() for rid, *_ in sent.seqs):
            self._ending[request_id] = (now, reason, recomputed, cached, preemptions)
            self.book.ending(self._keys[request_id][0])
        else:
            self._bill(request_id, now, reason, recomputed, cached, preemptions)
        return made

    def _bill(self, request_id: str, now: float, reason: str, recomputed: int,
              cached: int, preemptions: int) -> None:
        key, tenant = self._keys.pop(request_id, (request_id, ""))
        stats = self.accounting.finish(request_id, now, reason, num_recomputed_tokens=recomputed,
                                       num_cached_tokens=cached, num_preemptions=preemptions)
        cost, tier = stats.cost, stats.billed_tier.label
        pps = self.price_per_s
        record = {"prefill_usd": cost.prefill_cost * pps, "decode_usd": cost.decode_cost * pps,
                  "machine_usd": cost.machine_cost * pps,
                  "prefill_machine_s": cost.prefill_cost, "decode_machine_s": cost.decode_cost,
                  "tier": tier, "tenant": tenant,
                  "finish_reason": reason, "refused": reason == "refused",
                  "steps": cost.num_steps, "mean_batch_size": cost.mean_batch_size,
                  "queue_s": stats.queue_s, "ttft_s": stats.ttft_s,
                  "tpot_s": stats.tpot_s, "itl_max_s": max(stats.inter_token_s, default=None),
                  "prompt_tokens": stats.num_prompt_tokens, "cached_tokens": cached,
                  "output_tokens": stats.num_output_tokens, "recomputed_tokens": recomputed,
                  "preemptions": preemptions}
        self.book.finished(key, tier, record)
        self._publish(now)

    # ---------------------------------------------------------------- steps
    def sent(self, step_id, seqs: list[tuple[str, int, int, bool]], now: float,
             capped: bool) -> None:
        if not seqs:
            return
        predicted = self.model.predict_s([(n, c) for _, n, c, _ in seqs]) \
            if self.model is not None else None
        self._sent[step_id] = Sent(now, seqs, predicted, capped and
                                   any(not d for *_, d in seqs))

    def done(self, step_id, now: float, kv_usage: float = 0.0,
             num_waiting: int = 0) -> tuple[float, Sent] | None:
        """The step's output is back: its measured time (and what was sent), booked and
        split; None for a step with nothing in it."""
        sent = self._sent.pop(step_id, None)
        if sent is None:
            return None
        start = sent.at if self._last_done is None else max(self._last_done, sent.at)
        follows, self._busy_end = self._busy_end, None
        self._last_done = self._booked_at = now
        duration = now - start
        if duration <= 0:
            self._settle_ended()
            return None
        self._samples.append(([(n, c) for _, n, c, _ in sent.seqs], duration))
        self._since_fit += 1
        if len(self._samples) >= MIN_FIT_STEPS and (self.model is None
                                                   or self._since_fit >= FIT_EVERY):
            try:
                self.model = StepTimeModel.fit(list(self._samples), relative=True)
                self.meter.work_model = self.model
                self.book.note(step_time_model=asdict(self.model))
                self._since_fit = 0
            except ConfigError:
                pass
        self.accounting.step(StepStats(
            step_index=0, start_time=start, duration_s=duration, num_seqs=len(sent.seqs),
            num_prefill_tokens=sum(n for _, n, _, d in sent.seqs if not d),
            num_decode_tokens=sum(1 for *_, d in sent.seqs if d), num_preempted=0,
            kv_usage=kv_usage, num_waiting=num_waiting,
            seqs=[SeqStepStats(rid, n, c, d) for rid, n, c, d in sent.seqs],
            follows=follows))
        self._settle_ended()
        self._publish(now)
        return duration, sent

    def left(self, busy: bool) -> None:
        """After a step's output is handled: whether the engine still has requests, so
        the next step follows this one back to back (StepStats.follows, which the step
        log times records from)."""
        self._busy_end = self._last_done if busy else None

    def _settle_ended(self) -> None:
        """Bill the ended requests no step in flight holds any more."""
        if not self._ending:
            return
        held = {rid for s in self._sent.values() for rid, *_ in s.seqs}
        for rid in [r for r in self._ending if r not in held]:
            self._bill(rid, *self._ending.pop(rid))

    def _publish(self, now: float) -> None:
        pps = self.price_per_s
        self.book.set_machine(self.meter.machine_cost * pps, self.meter.idle_cost * pps,
                              self._booked_at, busy=bool(self.accounting.stats))
