"""Cost for a replica the gateway cannot see inside: its machine cost over time, split
among the requests it was running, interval by interval, from the token timings the
gateway observes.

NOTE: the split
    The replica's timeline is cut at every event the gateway sees on it (a request sent,
    a chunk of tokens, a request done). Between two events the set of requests and what
    each is doing are taken as constant. The interval costs `dt * price`; if nothing is
    running it is idle. Otherwise each running request has a work rate, in seconds of the
    step-time model's per-sequence work per second of wall time (core/step_time.py, the
    same model the engine's meter splits by):
      prefill  its prompt's work W = seq_cost(prompt - cached, prompt), done at the pace
               of that prompt alone, W / predict([(prompt - cached, prompt)]), until W is
               used up (then it waits for its first token at rate 0: it is queued);
      decode   seq_cost(1, context) per token, over the smoothed gap between its chunks.
    What the rates leave of each second, 1 - sum(rates) (the fixed part: weights streamed
    once per step, overhead), is shared equally by the requests working in the interval,
    like the engine meter's fixed share. Weights are normalised so each interval's cost is
    fully attributed: per replica, requests + idle == machine cost (property-tested), and
    the estimate is checked against a tierserve replica's exact meter.
"""

from dataclasses import dataclass

from tierserve.core.stats import RequestCost
from tierserve.core.step_time import StepTimeModel
from tierserve.metering.cost import CostMeter

GAP_SMOOTHING = 0.3
MIN_INTERVAL_S = 0.002
"""Events closer than this fall into one interval: a replica's chunks for a whole batch
arrive within a millisecond, and splitting per chunk would cost the gateway CPU."""


@dataclass
class _Running:
    prompt_tokens: int
    cached_tokens: int
    prefill_left: float
    """Model seconds of prefill work not yet attributed."""
    prefill_rate: float
    decoding: bool = False
    context: int = 0
    gap_s: float = 0.0
    last_token: float = 0.0


class ReplicaMeter(CostMeter):
    """A CostMeter fed by request events instead of engine steps."""

    def __init__(self, price_per_hour: float, work_model: StepTimeModel):
        super().__init__(price_per_hour, work_model=work_model)
        self.running: dict[str, _Running] = {}
        self.attributed = 0.0
        """Machine cost given to requests so far (the rest is idle)."""
        self._t: float | None = None

    def start(self, request_id: str, now: float, prompt_tokens: int,
              cached_tokens: int = 0) -> None:
        self.advance(now)
        m = self.work_model
        new = max(1, prompt_tokens - cached_tokens)
        work = m.seq_cost_s(new, prompt_tokens)
        alone = max(m.predict_s([(new, prompt_tokens)]), 1e-6)
        self.running[request_id] = _Running(prompt_tokens, cached_tokens, work, work / alone,
                                            context=prompt_tokens)

    def tokens(self, request_id: str, now: float, n: int = 1) -> None:
        """`n` output tokens arrived for the request (its first ones end its prefill)."""
        self.advance(now)
        run = self.running.get(request_id)
        if run is None or n <= 0:
            return
        if not run.decoding:  # prefill work the rate did not reach was paid by time
            run.prefill_left, run.decoding = 0.0, True
            run.gap_s = self.work_model.predict_s([(1, run.context)])
        else:
            gap = (now - run.last_token) / n
            run.gap_s += GAP_SMOOTHING * (gap - run.gap_s)
        run.context += n
        run.last_token = now

    def finish(self, request_id: str, now: float) -> RequestCost:
        """The request left the replica: its cost so far (forgotten here)."""
        self.advance(now)
        self.running.pop(request_id, None)
        return self.take(request_id)

    # ------------------------------------------------------------ intervals
    def advance(self, now: float) -> None:
        """Close the interval up to `now` among the running requests."""
        if self._t is None:
            self._t = now
            self._last_end = now
            return
        dt = now - self._t
        if dt < MIN_INTERVAL_S:  # events this close share an interval (and its rates)
            return
        rates = {rid: self._rate(run, dt) for rid, run in self.running.items()}
        working = {rid: r for rid, r in rates.items()
                   if r > 0 or self.running[rid].decoding}
        if working:
            self._split(self._t, dt, working)
        self._t = now

    def _rate(self, run: _Running, dt: float) -> float:
        if run.decoding:
            return self.work_model.seq_cost_s(1, run.context) / max(run.gap_s, 1e-6)
        return min(run.prefill_rate, run.prefill_left / dt)

    def _split(self, start: float, dt: float, rates: dict[str, float]) -> None:
        fixed = max(0.0, 1.0 - sum(rates.values())) / len(rates)
        weights = {rid: r + fixed for rid, r in rates.items()}
        total = sum(weights.values())
        self._add_idle(start)
        cost = dt * self.price_per_second
        self.machine_cost += cost
        for rid, w in weights.items():
            run = self.running[rid]
            rc = self.costs[rid]
            share = cost * w / total
            self.attributed += share
            if run.decoding:
                rc.decode_cost += share
            else:
                rc.prefill_cost += share
                run.prefill_left = max(0.0, run.prefill_left - rates[rid] * dt)
            rc.num_steps += 1
            rc.batch_size_sum += len(rates)
        self._last_end = start + dt
