"""RequestQueue semantics, one by one, for the FCFS deque and the priority heap."""

from __future__ import annotations

import random

import pytest

from scheduler.placement import Placement
from scheduler.request import Request, RequestStatus
from scheduler.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    RequestQueue,
    SchedulingPolicy,
    create_request_queue,
)
from scheduler.sampling_params import SamplingParams
from tests.support.scheduler_helpers import FakeClock


def req(request_id: str, priority: int = 0, arrival: float = 0.0,
        bound: int | None = None) -> Request:
    return Request(request_id, [1, 2, 3], SamplingParams(),
                   placement=Placement(priority=priority, priority_bound=bound),
                   arrival_time=arrival)


def ids(queue: RequestQueue) -> list[str]:
    return [r.request_id for r in queue]


@pytest.fixture(params=["fcfs", "priority"])
def queue(request: pytest.FixtureRequest) -> RequestQueue:
    return create_request_queue(request.param)


# ---- common semantics ----


def test_empty_queue(queue: RequestQueue) -> None:
    assert len(queue) == 0
    assert not queue
    assert list(queue) == []
    with pytest.raises(IndexError):
        queue.pop()
    with pytest.raises(IndexError):
        queue.peek()


def test_add_pop_in_arrival_order_when_priorities_equal(queue: RequestQueue) -> None:
    for i in range(4):
        queue.add(req(f"r{i}", arrival=float(i)))
    assert len(queue) == 4
    assert queue
    assert [queue.pop().request_id for _ in range(4)] == ["r0", "r1", "r2", "r3"]
    assert not queue


def test_peek_leaves_request(queue: RequestQueue) -> None:
    a, b = req("a", arrival=0), req("b", arrival=1)
    queue.add(a)
    queue.add(b)
    assert queue.peek() is a
    assert queue.peek() is a
    assert len(queue) == 2
    assert queue.pop() is a


def test_remove_from_middle(queue: RequestQueue) -> None:
    rs = [req(f"r{i}", arrival=float(i)) for i in range(5)]
    for r in rs:
        queue.add(r)
    queue.remove(rs[2])
    assert ids(queue) == ["r0", "r1", "r3", "r4"]
    assert [queue.pop().request_id for _ in range(4)] == ["r0", "r1", "r3", "r4"]


def test_remove_missing_raises(queue: RequestQueue) -> None:
    queue.add(req("a"))
    with pytest.raises(ValueError):
        queue.remove(req("b"))
    assert len(queue) == 1


def test_iteration_leaves_queue_intact(queue: RequestQueue) -> None:
    for i in (3, 1, 2, 0):
        queue.add(req(f"r{i}", arrival=float(i)))
    first = ids(queue)
    assert ids(queue) == first
    assert len(queue) == 4
    assert [queue.pop().request_id for _ in range(4)] == first


def test_prepend_requests_keeps_their_order(queue: RequestQueue) -> None:
    rs = [req(f"r{i}", arrival=float(i)) for i in range(4)]
    queue.add(rs[2])
    queue.add(rs[3])
    queue.prepend_requests([rs[0], rs[1]])
    assert [queue.pop().request_id for _ in range(4)] == ["r0", "r1", "r2", "r3"]


def test_without_aging_time_changes_nothing(queue: RequestQueue) -> None:
    rs = [req("a", priority=1, arrival=0), req("b", priority=0, arrival=5)]
    for r in rs:
        queue.add(r)
    before = ids(queue)
    assert [queue.effective_priority(r, 1e9) for r in rs] == [1, 0]
    assert ids(queue) == before


def test_lazy_removal_then_requeue(queue: RequestQueue) -> None:
    rs = [req(f"r{i}", arrival=i) for i in range(4)]
    for r in rs:
        queue.add(r)
    queue.remove(rs[0])
    queue.remove(rs[2])
    assert rs[0] not in queue and rs[1] in queue and len(queue) == 2
    queue.add(rs[0])  # queued again: its stale entry must not count twice
    assert ids(queue) == ["r0", "r1", "r3"] if queue.peek() is rs[0] else ["r1", "r3", "r0"]
    assert sorted(r.request_id for r in (queue.pop(), queue.pop(), queue.pop())) == [
        "r0", "r1", "r3"
    ]
    assert not queue
    with pytest.raises(IndexError):
        queue.peek()


def test_queued_twice_is_an_error(queue: RequestQueue) -> None:
    r = req("r")
    queue.add(r)
    with pytest.raises(ValueError, match="already"):
        queue.add(r)


def test_many_removals_compact_and_keep_order(queue: RequestQueue) -> None:
    rs = [req(f"r{i:04d}", priority=i % 3, arrival=i) for i in range(1000)]
    for r in rs:
        queue.add(r)
    for i, r in enumerate(rs):
        if i % 10:
            queue.remove(r)
    kept = [r for i, r in enumerate(rs) if i % 10 == 0]
    assert len(queue) == len(kept)
    assert sorted(queue.count_by_priority().items()) == [(0, 34), (1, 33), (2, 33)]
    popped = [queue.pop() for _ in range(len(kept))]
    assert {r.request_id for r in popped} == {r.request_id for r in kept}
    assert queue.count_by_priority() == {}


def test_head_is_the_first_in_pop_order(queue: RequestQueue) -> None:
    rs = [req(f"r{i}", priority=-i, arrival=i) for i in range(6)]
    for r in rs:
        queue.add(r)
    assert [r.request_id for r in queue.head(3)] == ids(queue)[:3]
    assert len(queue) == 6


# ---- FCFS ----


def test_fcfs_ignores_priority() -> None:
    queue = FCFSRequestQueue()
    queue.add(req("low", priority=5, arrival=0))
    queue.add(req("high", priority=-5, arrival=1))
    assert queue.pop().request_id == "low"


def test_fcfs_prepend_puts_at_head() -> None:
    queue = FCFSRequestQueue()
    queue.add(req("a", arrival=0))
    late = req("late", arrival=10)
    queue.prepend(late)
    assert queue.peek() is late
    assert ids(queue) == ["late", "a"]


# ---- priority ----


def test_priority_pops_lowest_value_first() -> None:
    queue = PriorityRequestQueue()
    for name, priority in [("p2", 2), ("p0", 0), ("pm1", -1), ("p1", 1)]:
        queue.add(req(name, priority=priority))
    assert [queue.pop().request_id for _ in range(4)] == ["pm1", "p0", "p1", "p2"]


def test_priority_ties_by_arrival_then_id() -> None:
    queue = PriorityRequestQueue()
    queue.add(req("b", priority=1, arrival=1.0))
    queue.add(req("late", priority=1, arrival=2.0))
    queue.add(req("a", priority=1, arrival=1.0))
    assert ids(queue) == ["a", "b", "late"]


def test_priority_prepend_adds_by_order() -> None:
    queue = PriorityRequestQueue()
    queue.add(req("urgent", priority=0, arrival=5))
    queue.prepend(req("preempted", priority=3, arrival=0))
    assert ids(queue) == ["urgent", "preempted"]


def test_priority_iteration_is_sorted_and_heap_intact() -> None:
    queue = PriorityRequestQueue()
    for i, priority in enumerate([5, 3, 8, 1, 3, 0]):
        queue.add(req(f"r{i}", priority=priority, arrival=float(i)))
    assert ids(queue) == ["r5", "r3", "r1", "r4", "r0", "r2"]
    assert [queue.pop().request_id for _ in range(6)] == ["r5", "r3", "r1", "r4", "r0", "r2"]


def test_priority_remove_keeps_heap_order() -> None:
    queue = PriorityRequestQueue()
    rs = [req(f"r{i}", priority=p, arrival=float(i)) for i, p in enumerate([4, 2, 6, 0, 3])]
    for r in rs:
        queue.add(r)
    queue.remove(rs[3])
    queue.remove(rs[4])
    assert [queue.pop().request_id for _ in range(3)] == ["r1", "r0", "r2"]


def test_aging_improves_effective_priority_of_long_waiters() -> None:
    queue = PriorityRequestQueue(aging_s=10.0)
    old = req("old", priority=3, arrival=0.0)
    new = req("new", priority=1, arrival=50.0)
    queue.add(old)
    queue.add(new)
    assert queue.peek() is old  # waited 50 s: 3 - 5 = -2 < 1
    assert [queue.effective_priority(r, 50.0) for r in (old, new)] == [-2, 1]
    assert ids(queue) == ["old", "new"]
    assert queue.peek_most_urgent() is new  # the base priority decides who may preempt


def test_aging_steps_one_level_per_period() -> None:
    queue = PriorityRequestQueue(aging_s=10.0)
    r = req("r", priority=5, arrival=0.0)
    queue.add(r)
    levels = [queue.effective_priority(r, now) for now in (5.0, 9.9, 10.0, 19.9, 20.0, 35.0)]
    assert levels == [5, 5, 4, 4, 3, 2]
    late = req("late", priority=3, arrival=34.0)
    queue.add(late)
    assert [queue.effective_priority(x, 44.0) for x in (r, late)] == [1, 2]
    assert ids(queue) == ["r", "late"]


def test_aging_order_is_a_static_key() -> None:
    """Requests age at one rate, so the order never changes while they wait: a request
    that is behind stays behind until its rival leaves (no re-heapify needed)."""
    queue = PriorityRequestQueue(aging_s=10.0)
    a = req("a", priority=2, arrival=0.0)  # 2 - t/10
    b = req("b", priority=0, arrival=25.0)  # 0 - (t - 25)/10: behind a by 0.5 levels
    queue.add(a)
    queue.add(b)
    assert ids(queue) == ["a", "b"]
    c = req("c", priority=0, arrival=0.0)  # waited as long as a, two levels better
    queue.add(c)
    assert ids(queue) == ["c", "a", "b"]


def test_aging_counts_only_time_spent_waiting() -> None:
    queue = PriorityRequestQueue(aging_s=10.0)
    r = req("r", priority=5, arrival=0.0)
    r.status = RequestStatus.RUNNING
    r.stop_waiting(now=20.0)  # waited 20 s, then ran 100 s
    r.status = RequestStatus.PREEMPTED
    r.start_waiting(now=120.0)
    queue.add(r)
    assert queue.effective_priority(r, 125.0) == 5 - 2
    fresh = req("fresh", priority=3, arrival=120.0)  # 3 at 120 s; r is 5 - 2 = 3 then
    queue.add(fresh)
    assert ids(queue) == ["r", "fresh"]  # r waited 20 s more: 0.0 - 2 < 0.0


def test_aging_stops_at_the_floor_and_the_bound_and_the_order_follows() -> None:
    """At its limit a long waiter ties with the requests of that level (first by arrival),
    and a fresh request of a better level goes before it; a request more urgent than the
    floor does not age at all."""
    clock = FakeClock(0.0)
    queue = PriorityRequestQueue(aging_s=1.0, aging_floor=0, clock=clock)
    old = req("old", priority=9, arrival=0.0)
    bounded = req("bounded", priority=9, arrival=1.0, bound=4)
    urgent = req("urgent", priority=-3, arrival=0.0)
    for r in (old, bounded, urgent):
        queue.add(r)
    clock.now = 100.0
    peer, better = req("peer", priority=0, arrival=50.0), req("better", priority=-1, arrival=99)
    queue.add(peer)
    queue.add(better)
    assert [queue.effective_priority(r, 100.0) for r in (old, bounded, urgent)] == [0, 4, -3]
    order = ["urgent", "better", "old", "peer", "bounded"]
    assert ids(queue) == order and [queue.pop().request_id for _ in range(5)] == order


@pytest.mark.parametrize("seed", range(5))
def test_aging_with_limits_pops_in_the_order_of_the_priorities_now(seed: int) -> None:
    """Against a sort by (effective priority now, arrival) over random requests, floors,
    bounds and times (continuous aging, as the heap orders it)."""
    rng = random.Random(seed)
    clock = FakeClock(0.0)
    floor = rng.choice([None, 0, -5])
    queue = PriorityRequestQueue(aging_s=2.0, aging_floor=floor, clock=clock)
    live: list[Request] = []
    for i in range(200):
        clock.now += rng.random() * 3
        if live and rng.random() < 0.3:
            popped = queue.pop()
            expected = min(live, key=lambda r: _aged_key(r, clock.now, 2.0, floor))
            assert popped is expected
            live.remove(popped)
        else:
            r = req(f"r{i}", priority=rng.randint(-8, 8), arrival=clock.now,
                    bound=rng.choice([None, -2, 3]))
            queue.add(r)
            live.append(r)


def _aged_key(r: Request, now: float, aging_s: float, floor: int | None) -> tuple:
    bounds = [b for b in (floor, r.placement.priority_bound) if b is not None]
    aged = r.priority - (now - r.arrival_time) / aging_s
    if bounds:
        aged = max(aged, min(max(bounds), r.priority))
    return (aged, r.arrival_time, r.request_id)


def test_aging_rejects_non_positive_period() -> None:
    with pytest.raises(ValueError):
        PriorityRequestQueue(aging_s=0)


# ---- factory ----


@pytest.mark.parametrize(
    ("policy", "cls"),
    [
        ("fcfs", FCFSRequestQueue),
        ("priority", PriorityRequestQueue),
        (SchedulingPolicy.FCFS, FCFSRequestQueue),
        (SchedulingPolicy.PRIORITY, PriorityRequestQueue),
    ],
)
def test_create_request_queue(policy: SchedulingPolicy | str, cls: type[RequestQueue]) -> None:
    assert isinstance(create_request_queue(policy), cls)


def test_create_request_queue_unknown_policy() -> None:
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        create_request_queue("lifo")
