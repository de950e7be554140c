"""Stats are data: the request accounting (core/accounting.py) emits these dataclasses;
sinks (Prometheus, logs, benchmarks) consume them through the `StatSink` protocol. One
`Metering` consumer comes before every sink and returns each finished request's `Bill`:
the accounting puts it on the request's stats, so every later sink sees the cost. Plain
Python: the simulator uses it.
"""

from dataclasses import dataclass, field
from typing import Protocol

from tierserve.tiers import Tier


@dataclass
class SeqStepStats:
    """One sequence's part of a step: what the cost meter needs to attribute the step."""

    request_id: str
    num_tokens: int
    """Tokens computed for this sequence in the step."""
    context_len: int
    """KV positions attended after the step (prefix + these tokens)."""
    is_decode: bool


@dataclass
class StepStats:
    step_index: int
    start_time: float
    duration_s: float
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preempted: int
    kv_usage: float
    """Fraction of KV blocks in use after the step."""
    num_waiting: int
    seqs: list[SeqStepStats] = field(default_factory=list)
    engine: str = "0"
    """Which engine stepped (`fast` or `main` in the dedicated deployment), as vLLM's
    `engine` label."""
    model: str | None = None
    """The served model's name where a server serves several (None: its only one)."""
    follows: float | None = None
    """When the engine's step before this one ended, where it still had requests then
    (this step followed it back to back); None after idle, or where the stepper does not
    say."""

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


@dataclass
class RequestCost:
    """A request's machine cost, split by the cost meter (metering/cost.py)."""

    prefill_cost: float = 0.0
    decode_cost: float = 0.0
    num_steps: int = 0
    batch_size_sum: int = 0
    """Sum over the request's steps of the step's sequence count (for the mean batch)."""

    @property
    def machine_cost(self) -> float:
        return self.prefill_cost + self.decode_cost

    @property
    def mean_batch_size(self) -> float:
        return self.batch_size_sum / self.num_steps if self.num_steps else 0.0


@dataclass
class Bill:
    """What metering made of one finished request."""

    cost: RequestCost
    charge: float | None = None
    """What the tenant is charged (USD); None where no price list applies (simulator)."""


@dataclass
class RequestStats:
    """One request's timeline (arrival, first scheduled, first token, each token, finish)
    and counters; the raw material of TTFT, TPOT and SLO attainment."""

    request_id: str
    arrival_time: float
    tier: Tier = Tier.DEFAULT
    """The tier the request asked for (what per-tier latency reports group by)."""
    served_tier: Tier | None = None
    """The tier it was served and billed in (None: the one it asked for)."""
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    """Time each output token became available."""
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    num_draft_tokens: int = 0
    """Speculative decoding: draft tokens verified for it, and of them kept."""
    num_accepted_tokens: int = 0
    finish_reason: str | None = None
    cost: RequestCost | None = None
    """Machine cost, from the engine core's metering when the request finishes."""
    charge: float | None = None
    """What the tenant is charged (USD), from the same bill."""
    engine: str = "0"
    """The engine (dedicated deployment) or replica (fleet mode) that served it."""
    model: str | None = None
    """The served model's name where a server serves several (None: its only one)."""

    @property
    def billed_tier(self) -> Tier:
        return self.tier if self.served_tier is None else self.served_tier

    @property
    def queue_s(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def prefill_s(self) -> float | None:
        """First scheduling to first token."""
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_s(self) -> float | None:
        """First token to finish."""
        if self.finished_time is None or self.first_token_time is None:
            return None
        return self.finished_time - self.first_token_time

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_s(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None below two tokens)."""
        t = self.token_times
        if len(t) < 2:
            return None
        return (t[-1] - t[0]) / (len(t) - 1)

    def meets(self, ttft_s: float | None, tpot_s: float | None) -> bool:
        """Whether the request finished normally within both targets (None: no target)."""
        if self.finish_reason not in ("stop", "length") or self.ttft_s is None:
            return False
        if ttft_s is not None and self.ttft_s > ttft_s:
            return False
        return tpot_s is None or self.tpot_s is None or self.tpot_s <= tpot_s

    @property
    def inter_token_s(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


class StatSink(Protocol):
    def on_step(self, stats: StepStats) -> None: ...

    def on_request_finished(self, stats: RequestStats) -> None: ...


class Metering:
    """The one consumer that prices requests, called before any sink (core/accounting.py),
    so the meter-then-ledger order lives in one place. A meter of engine steps
    (metering/cost.py) uses `on_step`; a meter of a replica it cannot see inside
    (metering/estimate.py) uses the request events instead, from the token timings a
    gateway sees. Each ignores the events it has no use for."""

    def on_step_starting(self, start: float) -> None:
        """An engine step starts (the time before it was idle; idle accrual stops)."""

    def on_step(self, stats: StepStats) -> None:
        """An engine step ran (its sequences, start and duration)."""

    def on_scheduled(self, stats: RequestStats, now: float) -> None:
        """The request started on `stats.engine` (a replica: each attempt)."""

    def on_tokens(self, stats: RequestStats, n: int, now: float) -> None:
        """`n` output tokens of the request became available."""

    def on_left(self, stats: RequestStats, now: float) -> None:
        """The request left `stats.engine` (finished there, or failed and will retry)."""

    def on_reported_cost(self, stats: RequestStats, cost: RequestCost) -> None:
        """The unit that ran the request reported its exact machine cost."""

    def on_request_finished(self, stats: RequestStats) -> Bill:
        """The finished request's bill (its machine cost, and the charge if priced)."""
        raise NotImplementedError


class StatsCollector:
    """A sink that keeps everything in memory (benchmarks, tests)."""

    def __init__(self):
        self.steps: list[StepStats] = []
        self.requests: list[RequestStats] = []

    def on_step(self, stats: StepStats) -> None:
        self.steps.append(stats)

    def on_request_finished(self, stats: RequestStats) -> None:
        self.requests.append(stats)


def percentile(values, q: float) -> float | None:
    """The nearest-rank q-quantile of the non-None values (None if there are none)."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]
