"""Fair shares within a tier: start-time fair queuing over tenants, by tokens.

Tiers stay strictly ordered (the policy's rank comes first in every key); within a tier,
each tenant is one flow with a weight. A request gets a *start tag* when it arrives,

    S = max(V, F[tenant]),   then   F[tenant] = S + cost / weight,

where V is the tier's virtual time (the largest start tag the tier has dispatched) and
cost is the request's tokens (its prompt plus `max_tokens`, corrected to the tokens it
really produced when it finishes). The waiting queue is ordered by S, so:
  - one tenant alone is served in arrival order (its tags only grow);
  - a tenant that sends a burst of 100 gets tags spread far ahead of V, and another
    tenant's request arriving in the middle is tagged at V: it is served next, and the two
    then alternate by weight, whatever their arrival counts;
  - a tenant that was idle restarts at V, with no credit saved up and no penalty for
    having used spare capacity alone (the flaw of tagging by the wall clock).

Why start tags and not deficit round robin: the tag is fixed at arrival, so it is one
more field of the heap key the scheduler already keeps (O(log n), no per-tenant queues),
and a preempted request keeps its place as before.
"""

from collections import defaultdict


class FairShare:
    """Start tags of one engine's (or one gateway's) tiers. Callers pass plain values, so
    the scheduler (core.request.Request) and fleet mode's gateway (router.flow.Pending)
    share it."""

    def __init__(self):
        self._virtual: defaultdict[int, float] = defaultdict(float)
        """Tier -> virtual time: the largest start tag dispatched in that tier."""
        self._finish: dict[tuple[int, str], float] = {}
        """(tier, tenant) -> finish tag of the tenant's latest request in that tier."""
        self._last_start: dict[tuple[int, str], float] = {}

    def tag(self, tier: int, tenant: str, weight: float, cost: float) -> float:
        """The start tag of an arriving request of `cost` tokens (estimated)."""
        flow = (tier, tenant)
        start = max(self._virtual[tier], self._finish.get(flow, 0.0))
        self._finish[flow] = start + cost / weight
        self._last_start[flow] = start
        return start

    def dispatched(self, tier: int, tag: float) -> None:
        """A request is scheduled for the first time: the tier's virtual time moves on."""
        if tag > self._virtual[tier]:
            self._virtual[tier] = tag

    def finished(self, tier: int, tenant: str, weight: float, unused: float) -> None:
        """Correct the tenant's finish tag by the tokens its request was charged for but
        did not use (never below a tag already given out, so its requests stay in
        order)."""
        flow = (tier, tenant)
        if unused > 0 and flow in self._finish:
            self._finish[flow] = max(self._finish[flow] - unused / weight,
                                     self._last_start[flow])
