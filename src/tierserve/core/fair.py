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

from tierserve.core.request import Request


class FairShare:
    def __init__(self):
        self._virtual: defaultdict[int, float] = defaultdict(float)
        """Tier -> virtual time: the largest start tag dispatched in that tier."""
        self._finish: dict[tuple[int, str], float] = {}
        """(tier, tenant) -> finish tag of the tenant's latest request in that tier."""
        self._last_start: dict[tuple[int, str], float] = {}

    @staticmethod
    def estimate(request: Request) -> int:
        return request.num_prompt_tokens + request.max_tokens

    def tag(self, request: Request) -> None:
        """Give an arriving request its start tag."""
        flow = (int(request.tier), request.owner.tenant)
        start = max(self._virtual[int(request.tier)], self._finish.get(flow, 0.0))
        request.fair_tag = start
        self._finish[flow] = start + self.estimate(request) / request.owner.weight
        self._last_start[flow] = start

    def dispatched(self, request: Request) -> None:
        """A request is scheduled for the first time: the tier's virtual time moves on."""
        tier = int(request.tier)
        if request.fair_tag > self._virtual[tier]:
            self._virtual[tier] = request.fair_tag

    def finished(self, request: Request) -> None:
        """Correct the tenant's finish tag from the estimate to the tokens really computed
        (never below a tag already given out, so a tenant's requests stay in order)."""
        flow = (int(request.tier), request.owner.tenant)
        if flow not in self._finish:
            return
        unused = self.estimate(request) - request.num_tokens
        if unused > 0:
            self._finish[flow] = max(self._finish[flow] - unused / request.owner.weight,
                                     self._last_start[flow])
