"""Waiting queues: FCFS (a deque) and priority (a heap), behind one interface."""

from __future__ import annotations

import enum
import heapq
import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from scheduler.request import Request


class SchedulingPolicy(enum.Enum):
    """Order in which waiting requests are admitted."""

    FCFS = "fcfs"
    PRIORITY = "priority"


class RequestQueue(ABC):
    """A queue of waiting requests in policy order."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Add a request in policy order."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return the next request; IndexError when empty."""

    @abstractmethod
    def peek(self) -> Request:
        """The next request, left in place; IndexError when empty."""

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Put a request back at the front (a priority queue adds it by its order)."""

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Put requests back at the front, keeping their order among themselves."""
        for request in reversed(list(requests)):
            self.prepend(request)

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Remove one request; ValueError if it is not queued."""

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None:
        """Remove every given request that is queued, in one O(n) pass."""

    @abstractmethod
    def age(self, now: float) -> None:
        """Refresh effective priorities for aging at time `now` (no-op unless aging is on)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of queued requests."""

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Requests in the order they would be popped; the queue is left unchanged."""

    def __bool__(self) -> bool:
        """True when any request is queued."""
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    """First come, first served: a deque in arrival order."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        """Append at the back."""
        self._queue.append(request)

    def pop(self) -> Request:
        """Remove and return the front request; IndexError when empty."""
        if not self._queue:
            raise IndexError("pop from an empty request queue")
        return self._queue.popleft()

    def peek(self) -> Request:
        """The front request; IndexError when empty."""
        if not self._queue:
            raise IndexError("peek at an empty request queue")
        return self._queue[0]

    def prepend(self, request: Request) -> None:
        """Put at the front."""
        self._queue.appendleft(request)

    def remove(self, request: Request) -> None:
        """Remove one request; ValueError if it is not queued."""
        self._queue.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        """Remove every given request that is queued, in one O(n) pass."""
        drop = {id(request) for request in requests}
        self._queue = deque(r for r in self._queue if id(r) not in drop)

    def age(self, now: float) -> None:
        """No-op: FCFS order ignores priorities."""

    def __len__(self) -> int:
        """Number of queued requests."""
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        """Requests front to back."""
        return iter(self._queue)


# Heap entry: (effective priority, arrival time, request id, request). Ids are unique in a
# queue, so comparisons never reach the request itself.
_HeapEntry = tuple[int, float, str, Request]


def _entry(request: Request) -> _HeapEntry:
    return (request.effective_priority, request.arrival_time, request.request_id, request)


def _next_level_at(request: Request, aging_s: float) -> float:
    """When `request`, if it waits from now on, reaches the aging level after its current."""
    level = request.priority - request.effective_priority
    return request.waiting_since + (level + 1) * aging_s - request.waited_s


class PriorityRequestQueue(RequestQueue):
    """A heap ordered by (effective priority, arrival time, request id); lower first.

    With `aging_s`, `age(now)` lowers each request's effective priority by one level per
    `aging_s` seconds it has waited, then re-heapifies. NOTE: it only does that O(n) work
    when some request has crossed a level boundary since the last time, which it tracks as
    the earliest such boundary of any queued request. Without aging, the effective
    priority is the request's priority.
    """

    def __init__(self, aging_s: float | None = None) -> None:
        if aging_s is not None and aging_s <= 0:
            raise ValueError("aging_s must be > 0")
        self.aging_s = aging_s
        self._heap: list[_HeapEntry] = []
        # No queued request changes level before this time (may be early, never late).
        self._next_aging_at = math.inf

    def add(self, request: Request) -> None:
        """Add by priority order."""
        heapq.heappush(self._heap, _entry(request))
        if self.aging_s is not None:
            self._next_aging_at = min(
                self._next_aging_at, _next_level_at(request, self.aging_s)
            )

    def pop(self) -> Request:
        """Remove and return the most urgent request; IndexError when empty."""
        if not self._heap:
            raise IndexError("pop from an empty request queue")
        return heapq.heappop(self._heap)[-1]

    def peek(self) -> Request:
        """The most urgent request; IndexError when empty."""
        if not self._heap:
            raise IndexError("peek at an empty request queue")
        return self._heap[0][-1]

    def prepend(self, request: Request) -> None:
        """A heap has no front: add by priority order."""
        self.add(request)

    def remove(self, request: Request) -> None:
        """Remove one request; ValueError if it is not queued."""
        for i, entry in enumerate(self._heap):
            if entry[-1] is request:
                del self._heap[i]
                heapq.heapify(self._heap)
                return
        raise ValueError(f"request {request.request_id} is not in the queue")

    def remove_requests(self, requests: Iterable[Request]) -> None:
        """Remove every given request that is queued, in one O(n) pass."""
        drop = {id(request) for request in requests}
        self._heap = [entry for entry in self._heap if id(entry[-1]) not in drop]
        heapq.heapify(self._heap)

    def age(self, now: float) -> None:
        """Recompute effective priorities at `now` if any may have changed; re-heapify."""
        if self.aging_s is None or now < self._next_aging_at:
            return
        for _, _, _, request in self._heap:
            levels = int(request.time_waited(now) // self.aging_s)
            request.effective_priority = request.priority - max(levels, 0)
        self._heap = [_entry(request) for _, _, _, request in self._heap]
        heapq.heapify(self._heap)
        self._next_aging_at = min(
            (_next_level_at(r, self.aging_s) for _, _, _, r in self._heap), default=math.inf
        )

    def __len__(self) -> int:
        """Number of queued requests."""
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """Requests in pop order (a sorted copy: the heap is left as it is)."""
        return (entry[-1] for entry in sorted(self._heap))


def create_request_queue(
    policy: SchedulingPolicy | str, aging_s: float | None = None
) -> RequestQueue:
    """A queue for `policy` ("fcfs" or "priority"); ValueError on an unknown policy.

    `aging_s` turns on aging in a priority queue; FCFS ignores priorities, so it ignores it.
    """
    try:
        policy = SchedulingPolicy(policy)
    except ValueError:
        raise ValueError(f"unknown scheduling policy {policy!r}: use fcfs or priority") from None
    if policy is SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue(aging_s)
    return FCFSRequestQueue()
