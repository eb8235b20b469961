"""The scheduler's waiting queue, one class per policy (vLLM's request_queue.py).

FCFS: a deque in arrival order; preempted requests go back to the front.
PRIORITY: a heap ordered by (priority, arrival_time); lower is served first,
and a preempted request simply re-enters the heap at its old rank.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from jaxserve.config import SchedulingPolicy
from jaxserve.engine_core.request import Request


class RequestQueue(ABC):
    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def pop_request(self) -> Request: ...

    @abstractmethod
    def peek_request(self) -> Request: ...

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """Put a request back where it is served next (a preempted one)."""

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Requests in the order they would be served."""

    def __bool__(self) -> bool:
        return len(self) > 0

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Put back requests taken off the front, keeping their order."""
        for request in reversed(list(requests)):
            self.prepend_request(request)


class FCFSRequestQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def peek_request(self) -> Request:
        return self._queue[0]

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._queue = deque(r for r in self._queue if id(r) not in drop)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    def __init__(self) -> None:
        # NOTE: the counter breaks ties so Request objects are never compared.
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add_request(self, request: Request) -> None:
        heapq.heappush(
            self._heap, (request.priority, request.arrival_time, next(self._counter), request)
        )

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def peek_request(self) -> Request:
        return self._heap[0][-1]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._heap = [e for e in self._heap if id(e[-1]) not in drop]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[-1] for e in sorted(self._heap))


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    if policy is SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    return FCFSRequestQueue()


def select_victim(running: list[Request], policy: SchedulingPolicy) -> int:
    """Index in `running` of the request to preempt when pages run out (O(n), rare): FCFS
    the latest arrival; PRIORITY the highest priority value, then the latest arrival."""
    if policy is SchedulingPolicy.PRIORITY:
        return max(range(len(running)), key=lambda i: (running[i].priority, running[i].arrival_time))
    return max(range(len(running)), key=lambda i: running[i].arrival_time)
