"""The last few minutes of a server, in fixed time buckets, for the dashboard.

Prometheus keeps history for those who run one; the dashboard must show it without one,
so the server keeps its own short memory: per bucket, each tier's TTFT and inter-token
samples, tokens, the prefill/decode split of machine cost, and the queue and KV state
sampled once per bucket. Steps and finished requests arrive on the engine's thread and
samples and reads on the event loop, hence the lock.
"""

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from tierserve.core.stats import RequestStats, StepStats, percentile
from tierserve.tiers import Tier

MAX_SAMPLES = 400
"""Latency samples kept per tier per bucket: enough for a p99 over the window."""


@dataclass
class Bucket:
    start: float
    ttft: dict[Tier, list[float]] = field(default_factory=dict)
    itl: dict[Tier, list[float]] = field(default_factory=dict)
    prompt_tokens: int = 0
    output_tokens: int = 0
    """Tokens computed by engine steps (or, in fleet mode, by finished requests)."""
    prefill_cost: float = 0.0
    decode_cost: float = 0.0
    waiting: dict[Tier, int] = field(default_factory=dict)
    running: dict[Tier, int] = field(default_factory=dict)
    kv_usage: float | None = None


class Timeline:
    def __init__(self, interval_s: float = 2.0, keep: int = 150, window: int = 5,
                 clock=time.time):
        """`keep` buckets of `interval_s` (5 minutes); percentiles over `window` buckets,
        so a point is a 10-second p99, not one of a handful of samples."""
        self.interval_s, self.window, self.clock = interval_s, window, clock
        self.buckets: deque[Bucket] = deque(maxlen=keep)
        self.batch_sizes: deque[int] = deque(maxlen=2000)
        """Sequences per step, last 2000 steps."""
        self.steps_seen = False
        self._lock = threading.Lock()

    def _current(self) -> Bucket:
        now = self.clock()
        start = now - now % self.interval_s
        if not self.buckets or self.buckets[-1].start < start:
            self.buckets.append(Bucket(start))
        return self.buckets[-1]

    # StatSink --------------------------------------------------------------
    def on_step(self, s: StepStats) -> None:
        with self._lock:
            self.steps_seen = True
            b = self._current()
            b.prompt_tokens += s.num_prefill_tokens
            b.output_tokens += s.num_decode_tokens
            self.batch_sizes.append(s.num_seqs)

    def on_request_finished(self, s: RequestStats) -> None:
        tier = s.billed_tier
        with self._lock:
            b = self._current()
            if s.ttft_s is not None:
                _keep(b.ttft.setdefault(tier, []), [s.ttft_s])
            _keep(b.itl.setdefault(tier, []), s.inter_token_s)
            if s.cost is not None:
                b.prefill_cost += s.cost.prefill_cost
                b.decode_cost += s.cost.decode_cost
            if not self.steps_seen:  # fleet mode: replicas' steps are not seen here
                b.prompt_tokens += s.num_prompt_tokens - s.num_cached_tokens
                b.output_tokens += s.num_output_tokens

    def sample(self, waiting: dict[Tier, int], running: dict[Tier, int],
               kv_usage: float | None) -> None:
        with self._lock:
            b = self._current()
            b.waiting, b.running, b.kv_usage = dict(waiting), dict(running), kv_usage

    # reading ---------------------------------------------------------------
    def series(self) -> dict:
        """Columns for charts: times, and per tier or in total one value per bucket."""
        with self._lock:
            buckets = list(self.buckets)
            sizes = Counter(self.batch_sizes)
        tiers = sorted({t for b in buckets for t in (*b.ttft, *b.itl, *b.waiting, *b.running)})
        out = {"t": [b.start for b in buckets], "tiers": [t.label for t in tiers],
               "prompt_tps": [b.prompt_tokens / self.interval_s for b in buckets],
               "output_tps": [b.output_tokens / self.interval_s for b in buckets],
               "kv_usage": [b.kv_usage for b in buckets],
               "running": [sum(b.running.values()) for b in buckets],
               "waiting": [sum(b.waiting.values()) for b in buckets],
               "batch_sizes": {str(k): v for k, v in sorted(sizes.items())}}
        for name in ("ttft", "itl"):
            for q in (50, 99):
                out[f"{name}_p{q}"] = {t.label: self._windowed(buckets, name, t, q / 100)
                                       for t in tiers}
        out["waiting_by_tier"] = {t.label: [b.waiting.get(t, 0) for b in buckets]
                                  for t in tiers}
        shares = []
        for i in range(len(buckets)):
            part = buckets[max(0, i - self.window + 1):i + 1]
            pre, dec = sum(b.prefill_cost for b in part), sum(b.decode_cost for b in part)
            shares.append(pre / (pre + dec) if pre + dec > 0 else None)
        out["prefill_share"] = shares
        return out

    def _windowed(self, buckets: list[Bucket], name: str, tier: Tier, q: float) -> list:
        values = []
        for i in range(len(buckets)):
            samples = [v for b in buckets[max(0, i - self.window + 1):i + 1]
                       for v in getattr(b, name).get(tier, ())]
            values.append(percentile(samples, q))
        return values


def _keep(into: list[float], values: list[float]) -> None:
    """Append up to MAX_SAMPLES values, spread over `values` when there are more."""
    room = MAX_SAMPLES - len(into)
    if room <= 0 or not values:
        return
    stride = max(1, len(values) // room)
    into.extend(values[::stride][:room])
