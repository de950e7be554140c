"""vLLM's waiting queue in tierserve's order, for TieredScheduler (scheduler.py)."""

import heapq
import itertools

from vllm.v1.core.sched.request_queue import RequestQueue


class TierQueue(RequestQueue):
    """vLLM's waiting queue in tierserve's order (the NOTE at the top), with lower tiers
    hidden while `visible(request)` says no. Removal is lazy: an entry whose request left,
    or was re-keyed, is dropped when it reaches the top."""

    def __init__(self, key, visible):
        self._key, self._visible = key, visible
        self._heap: list = []
        self._current: dict[str, tuple] = {}  # request id -> its entry now
        self._seq = itertools.count()

    def add_request(self, request) -> None:
        entry = (self._key(request), next(self._seq), request)
        self._current[request.request_id] = entry
        heapq.heappush(self._heap, entry)

    def rekey(self, request) -> None:
        if request.request_id in self._current:
            self.add_request(request)

    def _top(self):
        heap, current = self._heap, self._current
        while heap and current.get(heap[0][2].request_id) is not heap[0]:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def peek_request(self):
        top = self._top()
        if top is None or not self._visible(top):
            raise IndexError("no request may start now")
        return top

    def pop_request(self):
        request = self.peek_request()
        heapq.heappop(self._heap)
        del self._current[request.request_id]
        return request

    def prepend_request(self, request) -> None:
        self.add_request(request)  # its key keeps its place, as in tierserve

    def prepend_requests(self, requests) -> None:
        for request in requests:
            self.add_request(request)

    def remove_request(self, request) -> None:
        self._current.pop(request.request_id, None)

    def remove_requests(self, requests) -> None:
        for request in requests:
            self._current.pop(request.request_id, None)

    def head(self):
        """The first request whether or not it may start now."""
        return self._top()

    def __bool__(self) -> bool:
        top = self._top()
        return top is not None and bool(self._visible(top))

    def __len__(self) -> int:
        return len(self._current)

    def count(self, predicate) -> int:
        """How many waiting requests `predicate(request)` holds for (no sort)."""
        return sum(1 for entry in self._current.values() if predicate(entry[2]))

    def __iter__(self):
        return iter([e[2] for e in sorted(self._current.values())])
