"""One request accounting for every path a request can take: the in-process engine and
its twin (through EngineCore) and a fleet gateway's remote replicas (router/fleet.py).

NOTE: what it owns
    Each unfinished request's `RequestStats` (its timeline and counters), the one
    `Metering` that prices it and the sinks that see it. Whoever runs the request reports
    what happened, in the same words on every path:

        start      accepted: arrival, tier asked for and served, prompt tokens
        scheduled  it started running on a unit (an engine, or a replica: every attempt)
        tokens     n output tokens became available at t
        usage      the unit reported its token counts (and maybe its exact cost)
        left       it left its unit (finished there, or failed: a retry may follow)
        restart    its tokens so far are void (a retry before anything was sent)
        step       an engine step starts, and ran (StepStats; in-process only)
        finish     it ended: counters, then the bill (metering first), then the sinks

    So how a request is timed and billed is written once: a change here is a change for
    the engine, the simulator and fleet mode together. Plain Python, no torch: the
    simulator and the vLLM plugin use it too.
"""

from tierserve.core.stats import Metering, RequestCost, RequestStats, StatSink, StepStats
from tierserve.tiers import Tier


class Accounting:
    def __init__(self):
        self.metering: Metering | None = None
        """Prices requests (and steps) before any sink sees them; None: unpriced."""
        self.sinks: list[StatSink] = []
        self.stats: dict[str, RequestStats] = {}
        """Unfinished requests' stats, by request id."""

    def start(self, request_id: str, arrival_time: float, asked: Tier, served: Tier,
              num_prompt_tokens: int) -> RequestStats:
        stats = RequestStats(request_id, arrival_time, tier=asked, served_tier=served,
                             num_prompt_tokens=num_prompt_tokens)
        self.stats[request_id] = stats
        return stats

    def scheduled(self, stats: RequestStats, now: float, unit: str | None = None) -> None:
        """It starts running now on `unit` (None: the engine that accounts it)."""
        if stats.first_scheduled_time is None:
            stats.first_scheduled_time = now
        if unit is not None:
            stats.engine = unit  # the last unit tried is the one that served it
        if self.metering is not None:
            self.metering.on_scheduled(stats, now)

    def tokens(self, stats: RequestStats, n: int, now: float) -> None:
        if n <= 0:
            return
        if stats.first_token_time is None:
            stats.first_token_time = now
        stats.token_times += [now] * n
        if self.metering is not None:
            self.metering.on_tokens(stats, n, now)

    def left(self, stats: RequestStats, now: float) -> None:
        if self.metering is not None:
            self.metering.on_left(stats, now)

    @staticmethod
    def usage(stats: RequestStats, prompt_tokens: int, cached_tokens: int,
              output_tokens: int) -> None:
        """The unit that ran it counted its tokens (they win over estimates)."""
        stats.num_prompt_tokens = prompt_tokens
        stats.num_cached_tokens = cached_tokens
        stats.num_output_tokens = output_tokens

    def reported_cost(self, stats: RequestStats, cost: RequestCost) -> None:
        if self.metering is not None:
            self.metering.on_reported_cost(stats, cost)

    @staticmethod
    def restart(stats: RequestStats) -> None:
        """Forget its tokens: it runs again from the start (nothing was sent of them)."""
        stats.first_token_time, stats.token_times = None, []

    def step_starting(self, start: float) -> None:
        if self.metering is not None:
            self.metering.on_step_starting(start)

    def step(self, stats: StepStats) -> None:
        if self.metering is not None:
            self.metering.on_step(stats)
        for sink in self.sinks:
            sink.on_step(stats)

    def finish(self, request_id: str, now: float, reason: str | None,
               **counters) -> RequestStats:
        """End the request: its counters (`num_output_tokens`, `num_cached_tokens`, ...;
        output tokens default to those it was seen to make), its bill, then the sinks."""
        stats = self.stats.pop(request_id)
        stats.finished_time = now
        stats.finish_reason = reason
        for name, value in counters.items():
            setattr(stats, name, value)
        if not stats.num_output_tokens:
            stats.num_output_tokens = len(stats.token_times)
        if self.metering is not None:
            bill = self.metering.on_request_finished(stats)
            stats.cost, stats.charge = bill.cost, bill.charge
        for sink in self.sinks:
            sink.on_request_finished(stats)
        return stats
