"""Ordering policies: who is served first and who is preempted first.

The scheduler keeps its queues sorted by `policy.key(request)` (smaller = served earlier).
When a request needs KV blocks and none are free, it may preempt a running request of the
same or a worse `rank` (never a better one); among those, the victim is the one with the
largest `victim_key`. A preempted request re-enters the waiting queue under its original
key, so it keeps its place.

Three policies, from plain to tier-aware:
    fcfs      arrival order; tiers ignored (rank 0 for all).
    priority  vLLM-style strict priority: tier, then the request's `priority`, then
              arrival. Victim: the running request ranked last.
    tiered    the same order, tenants sharing a tier fairly (core/fair.py: requests
              of one tier ordered by fair start tag, then arrival), plus the guarantees in `tiered` (the scheduler reads the
              flag): a waiting priority request may preempt lower tiers for slots and
              blocks, a step-time cap while priority decodes, reserves, default aging,
              a flex wait limit. Victim: lowest tier, then least progress lost (fewest
              computed tokens), then latest arrival.
"""

from typing import Protocol

from tierserve.core.request import Request
from tierserve.tiers import Tier


class SchedulingPolicy(Protocol):
    name: str
    tiered: bool
    """Whether the scheduler applies the tier guarantees (see module docstring)."""

    def rank(self, request: Request) -> int:
        """Class of the request: it may only be preempted for equal or better ranks."""

    def key(self, request: Request) -> tuple:
        """Sort key; smaller runs first."""

    def victim_key(self, request: Request) -> tuple:
        """Among preemptible running requests, the largest is preempted first."""

    def served_tier(self, tier: Tier) -> Tier:
        """The tier a request asking for `tier` is served and billed in."""


class FCFSPolicy:
    """First come, first served.

    Victim under KV pressure: the latest arrival among the running requests. It has waited
    least, and earlier arrivals keep their progress, so the oldest work finishes first and
    the queue cannot livelock by two requests preempting each other.
    """

    name = "fcfs"
    tiered = False

    def rank(self, request: Request) -> int:
        return 0

    def key(self, request: Request) -> tuple:
        return (request.arrival_time, request.arrival_seq)

    victim_key = key

    def served_tier(self, tier: Tier) -> Tier:
        return Tier.DEFAULT  # every request is served alike


class StrictPriorityPolicy:
    """vLLM's `priority` policy: (tier, priority, arrival). A waiting request never preempts
    (so once `max_num_seqs` requests run, a priority arrival waits for a slot), there is no
    budget cap, and cached blocks are evicted regardless of tier."""

    name = "priority"
    tiered = False

    def rank(self, request: Request) -> int:
        return int(request.tier)

    def key(self, request: Request) -> tuple:
        return (int(request.tier), request.priority, request.arrival_time, request.arrival_seq)

    victim_key = key

    def served_tier(self, tier: Tier) -> Tier:
        return tier


class TieredPolicy:
    """tierserve's policy: strict tier order with aging, and the tier guarantees.

    Victim: lowest tier first, then the request that has computed fewest tokens (the least
    work is thrown away and recomputed), then the latest arrival. The request that has made
    most progress is never the victim of its own tier, so it finishes: no livelock.
    """

    name = "tiered"
    tiered = True

    def rank(self, request: Request) -> int:
        return request.rank

    def key(self, request: Request) -> tuple:
        # An aged default request (rank above its tier) goes ahead of the priority tier's
        # own queue, and aged ones keep their fair order among themselves.
        return (request.rank, request.priority, request.rank == request.tier,
                request.fair_tag, request.arrival_time, request.arrival_seq)

    def victim_key(self, request: Request) -> tuple:
        return (request.rank, -request.num_computed_tokens, request.arrival_time,
                request.arrival_seq)

    def served_tier(self, tier: Tier) -> Tier:
        return tier


POLICIES = {p.name: p for p in (FCFSPolicy, StrictPriorityPolicy, TieredPolicy)}


def make_policy(name: str) -> SchedulingPolicy:
    return POLICIES[name]()
