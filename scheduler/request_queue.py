"""Waiting queues: FCFS (a deque) and priority (a heap), behind one interface.

Both remove lazily: `remove` forgets the request at once (O(1)) and its entry is dropped
when it reaches the front, so an abort never rebuilds the queue. Entries are tagged with a
sequence number, so a request removed and queued again is never confused with its stale
entry. A queue rebuilds itself (O(n)) only when stale entries outnumber live ones.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
import time
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator

from scheduler.request import Request


class SchedulingPolicy(enum.Enum):
    """Order in which waiting requests are admitted."""

    FCFS = "fcfs"
    PRIORITY = "priority"
    SLO = "slo"  # priority first, then slack to the latency targets (scheduler/slo.py)

    @property
    def ranks(self) -> bool:
        """Whether priority orders requests (and a better one may preempt a worse)."""
        return self is not SchedulingPolicy.FCFS


class RequestQueue(ABC):
    """A queue of waiting requests in policy order, with lazy removal."""

    def __init__(self) -> None:
        self._live: dict[str, int] = {}  # request id -> sequence number of its live entry
        self._num_by_priority: Counter[int] = Counter()
        self._seq = itertools.count()

    # ---- the interface ----

    @abstractmethod
    def add(self, request: Request) -> None:
        """Add a request in policy order; ValueError if it is queued already."""

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Put a request back at the front (a priority queue adds it by its order)."""

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Put requests back at the front, keeping their order among themselves."""
        for request in reversed(list(requests)):
            self.prepend(request)

    def pop(self) -> Request:
        """Remove and return the next request; IndexError when empty."""
        request = self.peek()
        self._forget(request)
        return request

    @abstractmethod
    def peek(self) -> Request:
        """The next request, left in place; IndexError when empty."""

    def remove(self, request: Request) -> None:
        """Remove one request in O(1) (its entry is dropped later); ValueError if it is not
        queued."""
        if request.request_id not in self._live:
            raise ValueError(f"request {request.request_id} is not in the queue")
        self._forget(request)
        self._maybe_compact()

    def __contains__(self, request: Request) -> bool:
        """Whether `request` is queued."""
        return request.request_id in self._live

    def __len__(self) -> int:
        """Number of queued requests."""
        return len(self._live)

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Requests in the order they would be popped; the queue is left unchanged."""

    def head(self, num_requests: int) -> list[Request]:
        """The first `num_requests` requests in pop order."""
        return list(itertools.islice(self, num_requests))

    def __bool__(self) -> bool:
        """True when any request is queued."""
        return bool(self._live)

    def effective_priority(self, request: Request, now: float) -> int:
        """`request`'s priority at `now`, aging counted (no aging here: its priority)."""
        return request.priority

    def peek_most_urgent(self) -> Request:
        """The request of the best base priority (the next one, unless aging or slack
        reorder); IndexError when empty."""
        return self.peek()

    def count_by_priority(self) -> dict[int, int]:
        """Queued requests per (base) priority, kept up to date as requests come and go."""
        return dict(self._num_by_priority)

    # ---- live entries ----

    def _enter(self, request: Request) -> int:
        """Mark `request` live; the sequence number of its new entry."""
        if request.request_id in self._live:
            raise ValueError(f"request {request.request_id} is queued already")
        seq = next(self._seq)
        self._live[request.request_id] = seq
        self._num_by_priority[request.priority] += 1
        return seq

    def _forget(self, request: Request) -> None:
        del self._live[request.request_id]
        self._num_by_priority[request.priority] -= 1
        if not self._num_by_priority[request.priority]:
            del self._num_by_priority[request.priority]

    def _is_live(self, request: Request, seq: int) -> bool:
        return self._live.get(request.request_id) == seq

    def _maybe_compact(self) -> None:
        if self._num_entries() > 2 * len(self._live) + 64:
            self._compact()

    @abstractmethod
    def _num_entries(self) -> int:
        """Entries stored, stale ones included."""

    @abstractmethod
    def _compact(self) -> None:
        """Drop every stale entry."""


class FCFSRequestQueue(RequestQueue):
    """First come, first served: a deque in arrival order."""

    def __init__(self) -> None:
        super().__init__()
        self._queue: deque[tuple[int, Request]] = deque()

    def add(self, request: Request) -> None:
        """Append at the back."""
        self._queue.append((self._enter(request), request))

    def prepend(self, request: Request) -> None:
        """Put at the front."""
        self._queue.appendleft((self._enter(request), request))

    def peek(self) -> Request:
        """The front request; IndexError when empty."""
        queue = self._queue
        while queue and not self._is_live(queue[0][1], queue[0][0]):
            queue.popleft()
        if not queue:
            raise IndexError("peek at an empty request queue")
        return queue[0][1]

    def __iter__(self) -> Iterator[Request]:
        """Requests front to back."""
        return (request for seq, request in self._queue if self._is_live(request, seq))

    def _num_entries(self) -> int:
        return len(self._queue)

    def _compact(self) -> None:
        self._queue = deque(e for e in self._queue if self._is_live(e[1], e[0]))


# Heap entry: (order key, order within the key, request id, sequence number, request);
# within a key requests go by fair-share tag when the scheduler set one (server with
# tenants), else by arrival time. Live ids
# are unique and a stale entry's sequence number differs from the live one's, so
# comparisons never reach the request itself.
_HeapEntry = tuple[float, float, str, int, Request]


class PriorityRequestQueue(RequestQueue):
    """A heap ordered by (priority, fair-share tag or arrival time, request id); lower
    first.

    With `aging_s`, a request's effective priority improves continuously, by one level per
    `aging_s` seconds waited (`effective_priority`), but never past its limit: the less
    urgent of `aging_floor` and its tenant's bound (`Placement.priority_bound`), and never
    past its own base priority either (a request more urgent than its limit does not age).
    NOTE: since every request ages at the same rate until it reaches its limit, the order
    of two aging requests never changes while they wait, so their heap is ordered by a
    static key, priority - (seconds waited before now) / aging_s taken at a common instant:
    no re-heapify, ever. A request whose key says it reached its limit moves, when it comes
    to the top, to a second heap ordered by (limit, tag or arrival): the one at the top of
    the aging heap has the lowest key, so none below it can be further than it is. A third
    heap in base-priority order answers `peek_most_urgent` (which request may preempt),
    since aging grants no preemption. `clock` tells the time for peek and iteration.
    """

    def __init__(self, aging_s: float | None = None, aging_floor: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if aging_s is not None and aging_s <= 0:
            raise ValueError("aging_s must be > 0")
        super().__init__()
        self.aging_s = aging_s
        self.aging_floor = aging_floor
        self._clock = clock
        self._heap: list[_HeapEntry] = []  # with aging: the requests still aging
        self._settled: list[_HeapEntry] = []  # only with aging: at their limit, by it
        self._by_base: list[_HeapEntry] = []  # only with aging; same entries, base order

    def add(self, request: Request) -> None:
        """Add by priority order."""
        seq = self._enter(request)
        order = request.arrival_time if request.fair_tag is None else request.fair_tag
        if self.aging_s is None:
            heapq.heappush(self._heap, (request.priority, order, request.request_id, seq,
                                        request))
            return
        limit = self._limit(request)
        if limit is not None and limit >= request.priority:
            heapq.heappush(self._settled, (request.priority, order, request.request_id, seq,
                                           request))
        else:
            heapq.heappush(self._heap, (self._key(request), order, request.request_id, seq,
                                        request))
        base = (request.priority, request.arrival_time, request.request_id, seq, request)
        heapq.heappush(self._by_base, base)

    def prepend(self, request: Request) -> None:
        """A heap has no front: add by priority order."""
        self.add(request)

    def peek(self) -> Request:
        """The most urgent request (aging counted); IndexError when empty."""
        if self.aging_s is None:
            return self._top(self._heap)
        shift = self._settle(self._clock())
        aging, settled = self._top_entry(self._heap), self._top_entry(self._settled)
        tops = [(e[0] - shift, *e[1:]) for e in (aging,) if e is not None]
        tops += [e for e in (settled,) if e is not None]
        if not tops:
            raise IndexError("peek at an empty request queue")
        return min(tops)[-1]

    def peek_most_urgent(self) -> Request:
        """The request of the best base priority (aging not counted)."""
        return self._top(self._by_base if self.aging_s is not None else self._heap)

    def effective_priority(self, request: Request, now: float) -> int:
        """`request`'s priority at `now` after aging: one level better per aging_s waited,
        down to its limit."""
        if self.aging_s is None:
            return request.priority
        aged = request.priority - int(request.time_waited(now) // self.aging_s)
        limit = self._limit(request)
        return aged if limit is None else max(aged, min(limit, request.priority))

    def __iter__(self) -> Iterator[Request]:
        """Requests in pop order (a sorted copy: the heap is left as it is)."""
        return (e[-1] for e in sorted(self._live_entries()))

    def head(self, num_requests: int) -> list[Request]:
        """The first `num_requests` requests in pop order, in O(n log num_requests)."""
        return [e[-1] for e in heapq.nsmallest(num_requests, self._live_entries())]

    def _limit(self, request: Request) -> int | None:
        """The most urgent priority aging may take `request` to (None: no limit)."""
        floor, bound = self.aging_floor, request.placement.priority_bound
        if floor is None or bound is None:
            return bound if floor is None else floor
        return max(floor, bound)

    def _key(self, request: Request) -> float:
        assert self.aging_s is not None
        # priority - time_waited(t) / aging_s, less the -t / aging_s all requests share
        return request.priority + (request.waiting_since - request.waited_s) / self.aging_s

    def _settle(self, now: float) -> float:
        """Move the aging requests at the top that reached their limit by `now` to the
        settled heap; returns the shift from a static key to the priority at `now`."""
        assert self.aging_s is not None
        shift = now / self.aging_s
        while (entry := self._top_entry(self._heap)) is not None:
            limit = self._limit(entry[-1])
            if limit is None or entry[0] - shift > limit:
                break
            heapq.heappop(self._heap)
            heapq.heappush(self._settled, (limit, *entry[1:]))
        return shift

    def _top_entry(self, heap: list[_HeapEntry]) -> _HeapEntry | None:
        while heap and not self._is_live(heap[0][-1], heap[0][3]):
            heapq.heappop(heap)
        return heap[0] if heap else None

    def _top(self, heap: list[_HeapEntry]) -> Request:
        entry = self._top_entry(heap)
        if entry is None:
            raise IndexError("peek at an empty request queue")
        return entry[-1]

    def _live_entries(self) -> Iterator[_HeapEntry]:
        """Every live entry, keyed by its priority now (aging counted)."""
        if self.aging_s is None:
            return (e for e in self._heap if self._is_live(e[-1], e[3]))
        shift = self._settle(self._clock())
        aging = (e for e in self._heap if self._is_live(e[-1], e[3]))
        settled = (e for e in self._settled if self._is_live(e[-1], e[3]))
        return itertools.chain(
            ((self._aged(e, shift), *e[1:]) for e in aging), settled)

    def _aged(self, entry: _HeapEntry, shift: float) -> float:
        limit = self._limit(entry[-1])
        return entry[0] - shift if limit is None else max(entry[0] - shift, limit)

    def _num_entries(self) -> int:
        return max(len(self._heap) + len(self._settled), len(self._by_base))

    def _compact(self) -> None:
        for heap in (self._heap, self._settled, self._by_base):
            heap[:] = [e for e in heap if self._is_live(e[-1], e[3])]
            heapq.heapify(heap)


# SLO heap entry: (priority, 0 on time / 1 late, latest start on time / arrival order
# late, order within the key, request id, sequence number, request).
_SloEntry = tuple[int, int, float, float, str, int, Request]


class SloRequestQueue(RequestQueue):
    """Priority first; within a level, requests that can still make their first token on
    time by least slack (earliest `latest_start`: the TTFT deadline less the predicted
    prefill), then those that cannot (by arrival or fair-share tag), then none missing.

    `latest_start(request)` is fixed when the request is added (a request without a TTFT
    target gets +inf: after every one with a target; a preempted one that has its first
    token -inf: its stream resumes first). Lateness only grows with time, so a static key
    suffices: at `peek` a top whose latest start is past moves to the late heap (the
    top of a level has its level's least key, so none below it is late unless it is).
    Requests that asked to be refused when late (`Placement.reject_late`) are in a third
    heap by latest start alone: `pop_late_rejects(now)` takes those that turned late.
    """

    def __init__(self, latest_start: Callable[[Request], float],
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._latest_start = latest_start
        self._clock = clock
        self._on_time: list[_SloEntry] = []
        self._late: list[_SloEntry] = []
        self._rejects: list[tuple[float, str, int, Request]] = []

    def add(self, request: Request) -> None:
        """Add by (priority, slack)."""
        seq = self._enter(request)
        order = request.arrival_time if request.fair_tag is None else request.fair_tag
        key = -math.inf if request.num_output_tokens else self._latest_start(request)
        entry = (request.priority, 0, key, order, request.request_id, seq, request)
        heapq.heappush(self._on_time, entry)
        if request.placement.reject_late and math.isfinite(key):
            heapq.heappush(self._rejects, (key, request.request_id, seq, request))

    def prepend(self, request: Request) -> None:
        """A heap has no front: add by its order."""
        self.add(request)

    def peek(self) -> Request:
        """The next request: on-time ones of the best level first; IndexError when empty."""
        top = self._top_on_time(self._clock())
        late = self._top(self._late)
        tops = [e for e in (top, late) if e is not None]
        if not tops:
            raise IndexError("peek at an empty request queue")
        return min(tops)[-1]

    def peek_most_urgent(self) -> Request:
        """The request of the best base priority."""
        tops = [e for e in (self._top(self._on_time), self._top(self._late)) if e is not None]
        if not tops:
            raise IndexError("peek at an empty request queue")
        return min(tops)[-1]

    def pop_late_rejects(self, now: float) -> list[Request]:
        """Remove and return the requests asking to be refused when late whose first token
        can no longer be on time at `now`."""
        rejects = self._rejects
        late = []
        while rejects and rejects[0][0] < now:
            _, _, seq, request = heapq.heappop(rejects)
            if self._is_live(request, seq):
                self._forget(request)
                late.append(request)
        return late

    def __iter__(self) -> Iterator[Request]:
        """Requests in pop order (a sorted copy)."""
        now = self._clock()
        live = [self._as_of(e, now) for e in (*self._on_time, *self._late)
                if self._is_live(e[-1], e[5])]
        return (e[-1] for e in sorted(live))

    @staticmethod
    def _as_of(entry: _SloEntry, now: float) -> _SloEntry:
        priority, late, key, order, request_id, seq, request = entry
        if late or key >= now:
            return entry
        return (priority, 1, order, order, request_id, seq, request)

    def _top_on_time(self, now: float) -> _SloEntry | None:
        """The top on-time entry, after moving the tops that turned late."""
        while (entry := self._top(self._on_time)) is not None and entry[2] < now:
            heapq.heappop(self._on_time)
            heapq.heappush(self._late, self._as_of(entry, now))
        return entry

    def _top(self, heap: list[_SloEntry]) -> _SloEntry | None:
        while heap and not self._is_live(heap[0][-1], heap[0][5]):
            heapq.heappop(heap)
        return heap[0] if heap else None

    def _num_entries(self) -> int:
        return max(len(self._on_time) + len(self._late), len(self._rejects))

    def _compact(self) -> None:
        for heap in (self._on_time, self._late):
            heap[:] = [e for e in heap if self._is_live(e[-1], e[5])]
            heapq.heapify(heap)
        self._rejects = [e for e in self._rejects if self._is_live(e[-1], e[2])]
        heapq.heapify(self._rejects)


def create_request_queue(
    policy: SchedulingPolicy | str,
    aging_s: float | None = None,
    aging_floor: int | None = None,
    clock: Callable[[], float] = time.monotonic,
    latest_start: Callable[[Request], float] | None = None,
) -> RequestQueue:
    """A queue for `policy` ("fcfs", "priority" or "slo"); ValueError on an unknown policy.

    `aging_s` turns on aging in a priority queue, down to `aging_floor` at most, timed by
    `clock`; FCFS ignores priorities, so it ignores them. Under slo, `latest_start` gives
    a request's slack key (without it, only priority and arrival order).
    """
    try:
        policy = SchedulingPolicy(policy)
    except ValueError:
        raise ValueError(f"unknown scheduling policy {policy!r}: use fcfs, priority or "
                         "slo") from None
    if policy is SchedulingPolicy.SLO:
        return SloRequestQueue(latest_start or (lambda request: math.inf), clock)
    if policy is SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue(aging_s, aging_floor, clock)
    return FCFSRequestQueue()
