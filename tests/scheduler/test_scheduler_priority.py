"""Priority over time and in the prefix cache: aging orders the waiting queue but grants
no preemption; an urgent prompt's cached blocks outlive a low-priority load."""

from __future__ import annotations

import pytest

from scheduler.placement import Placement
from scheduler.request import Request, RequestStatus
from tests.support.scheduler_helpers import (
    FakeClock,
    add_all,
    make_requests,
    make_scheduler,
    run_until_done,
    scheduled_ids,
    step,
)

# ---- aging ----


@pytest.mark.parametrize(("aging_s", "first"), [(None, "r1"), (10.0, "r0")])
def test_aging_lets_a_long_waiting_request_go_first(aging_s: float | None, first: str) -> None:
    clock = FakeClock(50.0)
    scheduler = make_scheduler(
        policy="priority", max_num_seqs=1, priority_aging_s=aging_s, clock=clock
    )
    (old,) = make_requests(1, 4, 1, priorities=[3], first_arrival=0.0)
    (new,) = make_requests(1, 4, 1, priorities=[1], first_id=1, first_arrival=50.0)
    add_all(scheduler, [new, old])
    out, _ = step(scheduler)
    assert scheduled_ids(out) == [first]  # old: 3 - 50 // 10 = -2 beats 1


def test_an_aged_request_is_preempted_by_a_strictly_better_base_priority() -> None:
    """Its aged priority shields a running request from nothing: victims go by base
    priority, and only a strictly better one preempts."""
    clock = FakeClock(30.0)
    scheduler = make_scheduler(
        policy="priority", max_num_seqs=1, priority_aging_s=10.0, clock=clock
    )
    (old,) = make_requests(1, 4, 5, priorities=[3], first_arrival=0.0)
    scheduler.add_request(old)
    step(scheduler)  # admitted with effective priority 0
    assert old.effective_priority == 0
    (peer,) = make_requests(1, 4, 1, priorities=[3], first_id=1, first_arrival=30.0)
    scheduler.add_request(peer)
    out, _ = step(scheduler)
    assert out.preempted_ids == []  # 3 vs 3: equal, not strictly better
    (fresh,) = make_requests(1, 4, 1, priorities=[0], first_id=2, first_arrival=30.0)
    scheduler.add_request(fresh)
    out, _ = step(scheduler)
    assert out.preempted_ids == ["r0"] and scheduled_ids(out) == ["r2"]


@pytest.mark.parametrize(("floor", "bound", "limit"), [
    (0, None, 0),  # the default floor: the default priority
    (-10, None, -10),
    (-10, 5, 5),  # the tenant's bound, when less urgent than the floor
    (5, -3, 5),
])
def test_aging_stops_at_the_floor_or_the_tenant_bound(floor, bound, limit) -> None:
    """A priority-10 request that waited an hour ages to its limit and no further: a
    fresh -10 request goes first, and preempts it once it runs."""
    clock = FakeClock(3600.0)
    scheduler = make_scheduler(policy="priority", max_num_seqs=1, priority_aging_s=1.0,
                               priority_aging_floor=floor, clock=clock)

    def waiter(i: int) -> Request:
        (low,) = make_requests(1, 4, 3, priorities=[10], first_id=i, first_arrival=0.0)
        low.placement = Placement(priority=10, priority_bound=bound)
        return low

    def urgent(i: int) -> Request:
        return make_requests(1, 4, 1, priorities=[-10], first_id=i, first_arrival=3600.0)[0]

    low = waiter(0)
    add_all(scheduler, [low, urgent(1)])
    assert scheduler.waiting.effective_priority(low, clock.now) == limit
    out, _ = step(scheduler)
    assert scheduled_ids(out) == ["r1"]
    run_until_done(scheduler)
    scheduler.add_request(low := waiter(2))
    step(scheduler)
    assert low.effective_priority == limit  # admitted at its limit
    scheduler.add_request(urgent(3))
    out, _ = step(scheduler)
    assert out.preempted_ids == ["r2"] and scheduled_ids(out) == ["r3"]


def test_aging_orders_the_queue_but_grants_no_preemption() -> None:
    clock = FakeClock(0.0)
    scheduler = make_scheduler(
        policy="priority", max_num_seqs=1, priority_aging_s=10.0, clock=clock
    )
    (running,) = make_requests(1, 4, 3, priorities=[2])
    scheduler.add_request(running)
    step(scheduler)
    (aged,) = make_requests(1, 4, 1, priorities=[3], first_id=1, first_arrival=0.0)
    scheduler.add_request(aged)
    clock.now = 100.0  # aged: 3 - 10 = -7, ahead of any newcomer
    (newcomer,) = make_requests(1, 4, 1, priorities=[1], first_id=2, first_arrival=100.0)
    scheduler.add_request(newcomer)
    order = [scheduled_ids(out) for out in run_until_done(scheduler)]
    # The aged request (base 3) cannot preempt the running one (2) and is parked at the
    # head; the newcomer behind it (1, strictly better than 2) still preempts. The aged
    # request then goes before the preempted one (2, aged by nothing yet).
    assert order == [["r2"], ["r1"], ["r0"], ["r0"]]
    assert (running.num_preemptions, aged.num_preemptions) == (1, 0)
    assert running.num_output_tokens == 3


def test_parked_head_keeps_its_free_blocks() -> None:
    """Past a parked head only preempting admissions go on, and they leave the head the
    free blocks it waits for."""
    scheduler = make_scheduler(policy="priority", num_blocks=8)
    (a,) = make_requests(1, 13, 3, priorities=[0])  # 4 blocks
    (low,) = make_requests(1, 5, 3, priorities=[5], first_id=1)  # 2 blocks
    scheduler.add_request(a)
    step(scheduler)
    scheduler.add_request(low)
    step(scheduler)  # 2 blocks free
    (big,) = make_requests(1, 20, 1, priorities=[1], first_id=2, first_arrival=2)  # 5 blocks
    (small,) = make_requests(1, 4, 1, priorities=[2], first_id=3, first_arrival=3)  # 1 block
    add_all(scheduler, [big, small])
    out, _ = step(scheduler)
    # big cannot fit even by preempting low (2 + 2 < 5): parked. small could take a free
    # block, but they are big's; preempting low would not leave big its 5 either.
    assert scheduled_ids(out) == ["r0", "r1"] and out.preempted_ids == []
    assert small.status is RequestStatus.WAITING
    run_until_done(scheduler)
    assert all(r.is_finished for r in (a, low, big, small))


def test_aging_does_not_make_two_requests_preempt_each_other() -> None:
    # Regression: with aging, a waiter used to beat the running request it waited for,
    # which then aged and beat it back, forever, on this workload.
    clock = FakeClock()
    scheduler = make_scheduler(
        policy="priority",
        num_blocks=4,
        max_num_seqs=1,
        max_num_batched_tokens=2,
        priority_aging_s=3.0,
        enable_prefix_caching=False,
        clock=clock,
    )
    (a,) = make_requests(1, 9, 5)
    (b,) = make_requests(1, 13, 1, first_id=1)
    add_all(scheduler, [a, b])
    for _ in range(100):
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler)
        clock.now += 1.0
    assert a.num_output_tokens == 5 and b.num_output_tokens == 1
    assert scheduler.num_preemptions_total == 0


# ---- prefix cache and priorities ----


def test_urgent_cached_prompt_survives_a_low_priority_load() -> None:
    scheduler = make_scheduler(policy="priority", num_blocks=20, max_num_seqs=2)
    system = list(range(500, 520))  # 5 full blocks of 4
    (urgent,) = make_requests(1, 24, 1, priorities=[-10], prefix=system)
    scheduler.add_request(urgent)
    run_until_done(scheduler)
    # a priority-10 load that cycles the pool (16 blocks) several times over
    load = make_requests(12, 20, 4, priorities=[10] * 12, first_id=1, first_arrival=1)
    add_all(scheduler, load)
    run_until_done(scheduler)
    (again,) = make_requests(1, 24, 1, priorities=[-10], prefix=system, first_id=20)
    hits_before = scheduler.kv_cache.prefix_cache_hits_tokens
    scheduler.add_request(again)
    step(scheduler)
    assert scheduler.kv_cache.prefix_cache_hits_tokens - hits_before == 20
    assert again.num_cached_tokens == 20


def test_prefix_cache_is_plain_lru_under_fcfs() -> None:
    scheduler = make_scheduler(num_blocks=20, max_num_seqs=2)
    system = list(range(500, 520))
    (first,) = make_requests(1, 24, 1, prefix=system)
    scheduler.add_request(first)
    run_until_done(scheduler)
    add_all(scheduler, make_requests(12, 20, 4, first_id=1, first_arrival=1))
    run_until_done(scheduler)
    (again,) = make_requests(1, 24, 1, prefix=system, first_id=20)
    scheduler.add_request(again)
    step(scheduler)
    assert again.num_cached_tokens == 0  # evicted, oldest first
