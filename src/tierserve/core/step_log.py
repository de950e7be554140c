"""An engine's recent steps as a replica serves them: what each step ran and how long a
token waited for it. A tierserve server keeps one and serves it at
`GET /tierserve/v1/steps`, and so does vLLM's engine core with tierserve's plugin
(vllm/meter.py); `tierserve calibrate --backend URL --from-steps` fits the
simulator's step-time model of that replica to it (router/calibrate.py).

NOTE: what a record's time is
    From the end of the step before to the end of this one, for a step that followed it
    back to back (the engine still had requests when that one ended: `StepStats.follows`
    is that end): the step's own compute, its scheduling, and the server's
    turn between steps (the tokens written to their streams), however long that turn
    took. That is what a token waits in steady state, where the step's compute alone is
    shorter: on a one-core replica of the fleet twin (2-core Zen 4) a lone decode step
    computed in 6.3-6.8 ms while steps ended 7.2-7.7 ms apart (docs/benchmarks.md). A
    step after idle (`after_idle` in its record) is timed from its own start, as the
    request that woke the engine waited for nothing before it.

    Until the thirty-fifth session steps after idle were left out; at 1.5 req/s over two
    one-core replicas most whole prompts run in such a step (a priority prompt on an idle
    replica, or the first of a burst), so the fit saw 4-5 steps of 50-250 prompt tokens
    among 3,000 and extrapolated from chunks under 50 tokens: 150-token prefills ran
    1.1-1.25x their prediction and the twin's priority TTFT came out 26-46% short.
"""

import threading
from collections import deque

from tierserve.core.stats import RequestStats, StepStats

KEEP = 16384
"""Records kept (about 2 minutes of lone decodes)."""


class StepLog:
    def __init__(self, model: str, keep: int = KEEP):
        """`model`: the name a step's record carries where its StepStats names none (a
        server's main model)."""
        self.model = model
        self.records: deque[dict] = deque(maxlen=keep)
        self.last_id = 0
        """The id of the newest record (ids count from 1, in order)."""
        self._lock = threading.Lock()

    # StatSink
    def on_step(self, s: StepStats) -> None:
        after_idle = s.follows is None
        record = {"model": s.model or self.model, "engine": s.engine,
                  "seqs": [[q.num_tokens, q.context_len] for q in s.seqs],
                  "seconds": s.duration_s if after_idle
                  else s.start_time + s.duration_s - s.follows,
                  "after_idle": after_idle}
        with self._lock:
            self.last_id += 1
            self.records.append({"id": self.last_id, **record})

    def on_request_finished(self, stats: RequestStats) -> None:
        pass

    def after(self, step_id: int = 0) -> tuple[list[dict], int]:
        """The records kept with ids above `step_id`, oldest first, and the newest id."""
        with self._lock:
            return [r for r in self.records if r["id"] > step_id], self.last_id
