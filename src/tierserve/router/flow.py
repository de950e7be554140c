"""Fleet mode's admission and routing: per-tier queues at the gateway, the replica each
request goes to, and when cheaper work may be released. Plain Python with time passed in:
the fleet backend (router/fleet.py) and the simulator (sim/loop.py) run this same code.

NOTE: tiers over replicas the gateway does not schedule
    A replica (vLLM, or any OpenAI-compatible server) schedules its own batch, and vLLM
    does not preempt for a slot once `max_num_seqs` run. So the gateway keeps the fast
    lane fast by holding cheaper work back rather than by preempting:
      - priority requests go at once to the replica with the best score (below), over any
        limit, with vLLM's `priority` field so the replica runs them first;
      - default, flex and batch requests wait in the gateway's per-tier queues (tier
        order, FIFO within a tier) and are released to a replica only while its in-flight
        lower-tier requests stay under `limit`, which leaves slots free for priority;
      - a flex request still queued after `flex_max_wait_s` is refused (429).

NOTE: the limit (AIMD on the fast lane's measured latency)
    Each replica's limit on in-flight lower-tier requests starts at its slot count less
    the slots kept for priority. Every priority request that finishes on it is checked
    against the priority SLO (TTFT and TPOT): a miss cuts the limit by `decrease`
    (multiplicative), at most once per `cooldown_s`; a met SLO while lower-tier work
    waits adds one slot (additive), up to the cap. With no priority SLO configured, the
    target is `idle_factor` times the replica's own idle timing, measured by the gateway
    at start (router/fleet.py's probe): TTFT as a base plus a cost per prompt token, so
    a long prompt is not read as a miss, and TPOT. With no priority traffic for
    `idle_s` the limit returns to the cap, so lower tiers alone are never throttled.
    AIMD is TCP's rule for sharing a link whose capacity is only seen through delay and
    loss: here capacity is only seen through the fast lane's latency, the signal is noisy
    (one slow prompt), and AIMD backs off fast on trouble and probes back slowly, which
    keeps the limit stable rather than oscillating with each sample; a fixed cap is
    either too tight (idle KV cache) or too loose (slow fast lane).

NOTE: the score (lower is better), a predicted time to first token in tokens of work
    queued prompt tokens the gateway sent and that have no first token yet
    + the request's own prompt tokens not already cached there (prefix affinity: the
      longest block-aligned prefix this replica was sent recently)
    + `decode_weight` x requests decoding there (each slows every step a little)
    + a penalty that grows with the replica's scraped KV-cache use and waiting queue
    Ties go round-robin. Affinity is weighed against load by the same unit: a shared
    prefix of P tokens is worth P tokens of queue. `routing: load` drops the affinity
    term; `routing: round-robin` drops the score altogether (each request to the next
    replica in turn that may take it), the baseline the other two are measured against.
"""

import itertools
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from tierserve.core.fair import FairShare
from tierserve.errors import ConfigError
from tierserve.tiers import Tier

PREFIX_BLOCK = 64
"""Tokens (or characters, for text prompts) per prefix-affinity block."""
ROUTINGS = ("affinity", "load", "round-robin")


@dataclass
class FlowConfig:
    reserved_priority_seqs: int = 4
    """Slots per replica that lower tiers leave free for priority requests."""
    priority_ttft_s: float | None = None
    """Priority TTFT target the limit adapts to (None: no TTFT signal)."""
    priority_tpot_s: float | None = None
    """Priority TPOT target the limit adapts to (None: no TPOT signal)."""
    idle_factor: float = 1.5
    """With no priority target given: the target is this many times the replica's idle
    TTFT (for the request's prompt length) and TPOT, measured at start."""
    decrease: float = 0.7
    """Multiplicative decrease of the limit on a priority SLO miss."""
    min_limit: int = 1
    """The limit never goes below this many lower-tier requests per replica."""
    cooldown_s: float = 1.0
    """At most one decrease per replica per this long (one burst, one cut)."""
    idle_s: float = 10.0
    """No priority request finished on a replica for this long: its limit is the cap."""
    flex_max_wait_s: float = 60.0
    """A flex request not released after this long is refused."""
    decode_weight: float = 16.0
    """Score tokens per request decoding on a replica."""
    routing: str = "affinity"
    """How a replica is chosen among those that may take the request: `affinity` (the
    score in the NOTE: load plus the prefix it was sent), `load` (the score without the
    prefix term) or `round-robin` (the next replica in turn, load and prefix ignored)."""
    prefix_memory: int = 4096
    """Prefix blocks remembered per replica (LRU)."""

    def __post_init__(self):
        if self.routing not in ROUTINGS:
            raise ConfigError(f"fleet: routing must be one of {', '.join(ROUTINGS)}, got "
                              f"{self.routing!r}")


@dataclass(eq=False)
class Pending:
    """A request the gateway holds or has sent."""

    request_id: str
    tier: Tier
    prompt_tokens: int
    """Prompt length (an estimate where only text is known)."""
    max_tokens: int
    arrival: float
    prefix_keys: list[int] = field(default_factory=list)
    """Hashes of the prompt's leading blocks, cumulative (for affinity)."""
    replica: "ReplicaState | None" = None
    first_token: float | None = None
    excluded: set = field(default_factory=set)
    """Replicas not to use again (a retry after a failure)."""
    tenant: str = ""
    weight: float = 1.0
    fair_tag: float = 0.0
    """Start tag in its tier's fair queue (core/fair.py): tenants share a tier by weight."""


@dataclass(eq=False)
class ReplicaState:
    """What the gateway knows of one replica."""

    name: str
    max_num_seqs: int = 256
    tiers: frozenset | None = None
    """Tiers it takes (None: all)."""
    healthy: bool = True
    kv_usage: float | None = None
    """Scraped from its /metrics, where it reports one."""
    num_waiting: int | None = None
    """Scraped: requests queued inside the replica."""
    in_flight: Counter = field(default_factory=Counter)
    """Requests the gateway has on it, by tier."""
    elsewhere: int = 0
    """Lower-tier requests other gateways of the same database have on it (published
    through metering/shared.py; 0 for a gateway alone)."""
    prefilling_tokens: int = 0
    decoding: int = 0
    limit: float = 0.0
    """In-flight lower-tier requests it may have (see the NOTE)."""
    last_priority_s: float = float("-inf")
    last_cut_s: float = float("-inf")
    idle_ttft: tuple[float, float] | None = None
    """Measured at start: idle TTFT as (seconds, seconds per prompt token)."""
    idle_tpot_s: float | None = None
    """Measured at start: idle seconds per output token."""
    protects: bool = False
    """It keeps the fast lane fast itself (tierserve's scheduler runs there: a tierserve
    replica or vLLM with the plugin): no lower-tier limit is held for it."""
    prefixes: OrderedDict = field(default_factory=OrderedDict, repr=False)

    @property
    def lower_in_flight(self) -> int:
        return sum(n for tier, n in self.in_flight.items() if tier != Tier.PRIORITY)

    @property
    def num_in_flight(self) -> int:
        return sum(self.in_flight.values())

    def takes(self, tier: Tier) -> bool:
        return self.healthy and (self.tiers is None or tier.label in self.tiers)

    def limits(self, tier: Tier) -> bool:
        """Whether a request of `tier` here counts against its lower-tier limit (shared
        with the other gateways where there are some)."""
        return tier != Tier.PRIORITY and not self.protects


def prefix_keys(tokens_or_text) -> list[int]:
    """Cumulative hashes of the leading PREFIX_BLOCK-sized blocks of a prompt."""
    keys, h = [], 0
    for start in range(0, len(tokens_or_text) - PREFIX_BLOCK + 1, PREFIX_BLOCK):
        h = hash((h, tuple(tokens_or_text[start:start + PREFIX_BLOCK])))
        keys.append(h)
    return keys


class Gateway:
    """The per-tier queues and the release rule over a set of replicas."""

    def __init__(self, replicas: list[ReplicaState], config: FlowConfig | None = None):
        self.config = config or FlowConfig()
        self.replicas = replicas
        for r in replicas:
            r.limit = self.cap(r)
        self.queues: dict[Tier, deque[Pending]] = {t: deque() for t in Tier}
        """Per tier, in fair order (start tag, then arrival): as the engine's scheduler."""
        self.fair = FairShare()
        self.acquire = None
        """`acquire(replica) -> bool`, where other gateways share the replicas: a slot of
        the lower-tier limit taken for all of them at once (metering/shared.py), asked
        before a lower-tier request is released to a replica that does not protect its
        own fast lane; None: this gateway's own count decides alone."""
        self._turn = itertools.count()
        self._next = 0  # round-robin routing: the replica to try first

    # ------------------------------------------------------------ queueing
    def cap(self, replica: ReplicaState) -> int:
        return max(self.config.min_limit,
                   replica.max_num_seqs - self.config.reserved_priority_seqs)

    def submit(self, request: Pending) -> None:
        request.fair_tag = self.fair.tag(int(request.tier), request.tenant, request.weight,
                                         request.prompt_tokens + request.max_tokens)
        queue = self.queues[request.tier]
        i = len(queue)
        while i and queue[i - 1].fair_tag > request.fair_tag:  # mostly at the end: O(1)
            i -= 1
        queue.insert(i, request)

    def remove(self, request: Pending) -> bool:
        """Take a request out of its queue (aborted before release)."""
        try:
            self.queues[request.tier].remove(request)
            return True
        except ValueError:
            return False

    @property
    def num_queued(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def release(self, now: float) -> tuple[list[tuple[Pending, ReplicaState]], list[Pending]]:
        """What may go now: (request, replica) pairs in release order, and the flex
        requests refused for waiting too long."""
        refused = self._refuse_overdue(now)
        out = []
        for tier in Tier:
            queue = self.queues[tier]
            while queue:
                request = queue[0]
                replica = self.pick(request, lower=tier != Tier.PRIORITY)
                if replica is not None and replica.limits(tier) \
                        and self.acquire is not None and not self.acquire(replica):
                    replica = None  # the shared limit is full: as if this one were
                if replica is None:
                    break  # FIFO within a tier: the head waits, so does the rest
                queue.popleft()
                self.fair.dispatched(int(tier), request.fair_tag)
                self.sent(request, replica, now)
                out.append((request, replica))
        self._probe(now)
        return out, refused

    def stranded(self) -> list[Pending]:
        """Take out the queued requests no healthy replica takes (their pool went down
        under them): they fail clearly rather than wait. Batch lines wait: their job runs
        on when a replica is back."""
        out = []
        for tier in Tier:
            if tier == Tier.BATCH or not self.queues[tier] or \
                    any(r.takes(tier) for r in self.replicas):
                continue
            out.extend(self.queues[tier])
            self.queues[tier].clear()
        return out

    def _refuse_overdue(self, now: float) -> list[Pending]:
        queue = self.queues[Tier.FLEX]  # in fair order, not arrival: look at each
        limit = self.config.flex_max_wait_s
        if not queue or all(now - p.arrival <= limit for p in queue):
            return []
        refused = [p for p in queue if now - p.arrival > limit]
        self.queues[Tier.FLEX] = deque(p for p in queue if now - p.arrival <= limit)
        return refused

    # -------------------------------------------------------------- routing
    def pick(self, request: Pending, lower: bool = True) -> ReplicaState | None:
        """The best replica for `request` (None: none may take it now)."""
        if self.config.routing == "round-robin":
            return self._next_in_turn(request, lower)
        best, best_score = None, None
        turn = next(self._turn)
        n = len(self.replicas)
        for i in range(n):
            r = self.replicas[(turn + i) % n]  # round-robin among equal scores
            if not self._may_take(r, request, lower):
                continue
            score = self.score(r, request)
            if best_score is None or score < best_score:
                best, best_score = r, score
        return best

    def _next_in_turn(self, request: Pending, lower: bool) -> ReplicaState | None:
        n = len(self.replicas)
        for i in range(n):
            k = (self._next + i) % n
            if self._may_take(self.replicas[k], request, lower):
                self._next = k + 1  # the turn moves only when a request goes
                return self.replicas[k]
        return None

    @staticmethod
    def _may_take(r: ReplicaState, request: Pending, lower: bool) -> bool:
        return r.takes(request.tier) and r.name not in request.excluded and \
            not (lower and not r.protects and r.lower_in_flight + r.elsewhere >= r.limit)

    def score(self, r: ReplicaState, request: Pending) -> float:
        cached = self.cached_tokens(r, request)
        score = (r.prefilling_tokens + request.prompt_tokens - cached
                 + self.config.decode_weight * r.decoding)
        if r.kv_usage is not None and r.kv_usage > 0.8:
            score *= 1 + 10 * (r.kv_usage - 0.8)
        if r.num_waiting:
            score += r.num_waiting * self.config.decode_weight * 4
        return score

    def cached_tokens(self, r: ReplicaState, request: Pending) -> int:
        if self.config.routing != "affinity":
            return 0
        matched = 0
        for key in request.prefix_keys:
            if key not in r.prefixes:
                break
            matched += 1
        return matched * PREFIX_BLOCK

    # ------------------------------------------------------ request events
    def sent(self, request: Pending, replica: ReplicaState, now: float) -> None:
        request.replica = replica
        replica.in_flight[request.tier] += 1
        replica.prefilling_tokens += request.prompt_tokens
        for key in request.prefix_keys:
            replica.prefixes[key] = None
            replica.prefixes.move_to_end(key)
        while len(replica.prefixes) > self.config.prefix_memory:
            replica.prefixes.popitem(last=False)

    def first_token(self, request: Pending, now: float) -> None:
        r = request.replica
        if r is None or request.first_token is not None:
            return
        request.first_token = now
        r.prefilling_tokens -= request.prompt_tokens
        r.decoding += 1

    def finished(self, request: Pending, now: float, ttft_s: float | None = None,
                 tpot_s: float | None = None) -> None:
        """The request left its replica (done, aborted or failed); a priority request's
        latency adjusts the replica's limit."""
        r = request.replica
        if r is None:
            self.remove(request)
            return
        request.replica = None
        r.in_flight[request.tier] -= 1
        if request.first_token is None:
            r.prefilling_tokens -= request.prompt_tokens
        else:
            r.decoding -= 1
        if request.tier == Tier.PRIORITY and ttft_s is not None:
            self.observe_priority(r, now, ttft_s, tpot_s, request.prompt_tokens)

    def retry(self, request: Pending) -> None:
        """Queue again at the head of its tier (a replica failed before a token)."""
        if request.replica is not None:
            request.excluded.add(request.replica.name)
            self.finished(request, 0.0)
        if len(request.excluded) >= len(self.replicas):  # tried them all: any may do again
            request.excluded.clear()
        request.first_token = None
        self.queues[request.tier].appendleft(request)

    # ---------------------------------------------------------------- limit
    def observe_priority(self, r: ReplicaState, now: float, ttft_s: float,
                         tpot_s: float | None, prompt_tokens: int = 0) -> None:
        c = self.config
        r.last_priority_s = now
        ttft_target, tpot_target = self.targets(r, prompt_tokens)
        missed = (ttft_target is not None and ttft_s > ttft_target) or (
            tpot_target is not None and tpot_s is not None and tpot_s > tpot_target)
        if missed:
            if now - r.last_cut_s >= c.cooldown_s:
                r.limit = max(c.min_limit, r.limit * c.decrease)
                r.last_cut_s = now
        elif self.num_queued and r.lower_in_flight >= r.limit - 1:
            r.limit = min(self.cap(r), r.limit + 1)

    def targets(self, r: ReplicaState, prompt_tokens: int) -> tuple[float | None, float | None]:
        """The priority (TTFT, TPOT) targets on `r` for a prompt this long: the SLO's, else
        `idle_factor` x the replica's measured idle timing (None: no signal)."""
        c = self.config
        if c.priority_ttft_s is not None or c.priority_tpot_s is not None:
            return c.priority_ttft_s, c.priority_tpot_s
        ttft = None if r.idle_ttft is None else \
            c.idle_factor * (r.idle_ttft[0] + r.idle_ttft[1] * prompt_tokens)
        tpot = None if r.idle_tpot_s is None else c.idle_factor * r.idle_tpot_s
        return ttft, tpot

    def _probe(self, now: float) -> None:
        for r in self.replicas:
            if now - r.last_priority_s >= self.config.idle_s:
                r.limit = self.cap(r)
