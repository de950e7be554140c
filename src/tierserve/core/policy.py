"""Ordering policies: who is served first and who is preempted first.

The scheduler keeps its queues sorted by `policy.key(request)` (smaller = served earlier)
and, when KV blocks run out, preempts the running request with the largest key. That one
rule keeps the two choices consistent: a request is never preempted to make room for one
the policy ranks below it.
"""

from typing import Protocol

from tierserve.core.request import Request


class SchedulingPolicy(Protocol):
    name: str

    def key(self, request: Request) -> tuple:
        """Sort key; smaller runs first, largest is the first preemption victim."""


class FCFSPolicy:
    """First come, first served.

    Victim under KV pressure: the latest arrival among the running requests. It has waited
    least, and earlier arrivals keep their progress, so the oldest work finishes first and
    the queue cannot livelock by two requests preempting each other.
    A preempted request re-enters the waiting queue under its original arrival key, so it
    keeps its place ahead of everything that arrived after it.
    """

    name = "fcfs"

    def key(self, request: Request) -> tuple:
        return (request.arrival_time, request.arrival_seq)
