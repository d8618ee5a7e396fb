"""Scheduler behaviour, driven by hand-made runner outputs (no model)."""

from __future__ import annotations

import json

import pytest

from scheduler.budget import prefill_cost
from scheduler.output import ModelRunnerOutput, ScheduledRequest
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler
from tests.support.scheduler_helpers import (
    FakeClock,
    fake_token,
    make_requests,
    make_runner_output,
    make_scheduler,
    num_tokens_by_id,
    run_until_done,
    scheduled_ids,
    step,
)

EOS = 2


def add_all(scheduler: Scheduler, requests: list[Request]) -> None:
    for request in requests:
        scheduler.add_request(request)


def undisturbed_outputs(requests: list[Request]) -> dict[str, list[int]]:
    """Output tokens of copies of `requests` run on a pool too large to preempt."""
    scheduler = make_scheduler(num_blocks=512, max_num_seqs=64, max_num_batched_tokens=4096)
    copies = [
        Request(r.request_id, r.prompt_token_ids, r.sampling_params, r.eos_token_ids)
        for r in requests
    ]
    add_all(scheduler, copies)
    run_until_done(scheduler)
    return {r.request_id: r.output_token_ids for r in copies}


# ---- basic flow ----


def test_prefill_then_decode_until_max_tokens() -> None:
    scheduler = make_scheduler()
    (r,) = make_requests(1, 10, 3)
    scheduler.add_request(r)
    out, updated = step(scheduler)
    (s,) = out.scheduled
    assert (s.token_ids, s.num_computed_tokens, s.sample) == (r.prompt_token_ids, 0, True)
    assert len(s.block_table) == 3
    assert s.prompt_token_ids is r.prompt_token_ids
    assert updated == [r] and r.num_output_tokens == 1 and r.num_computed_tokens == 10

    out, _ = step(scheduler)
    (s,) = out.scheduled
    assert (s.token_ids, s.num_computed_tokens, s.sample) == ([r.output_token_ids[0]], 10, True)
    out, updated = step(scheduler)
    assert updated == [r]
    assert r.status is RequestStatus.FINISHED_LENGTH_CAPPED and r.finish_reason == "length"
    assert r.num_output_tokens == 3
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks
    assert scheduler.schedule().finished_ids == ["r0"]


def test_chunked_prefill_across_steps() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    (r,) = make_requests(1, 20, 2)
    scheduler.add_request(r)
    chunks = []
    for _ in range(3):
        out, updated = step(scheduler)
        (s,) = out.scheduled
        chunks.append((s.num_computed_tokens, s.token_ids, s.sample, len(s.block_table)))
        assert updated == ([r] if s.sample else [])
    assert chunks == [
        (0, r.prompt_token_ids[0:8], False, 5),  # blocks for the whole prompt up front
        (8, r.prompt_token_ids[8:16], False, 5),
        (16, r.prompt_token_ids[16:20], True, 5),
    ]
    assert r.num_output_tokens == 1
    out, _ = step(scheduler)
    assert out.scheduled[0].num_computed_tokens == 20
    assert r.is_finished


def test_mixed_prefill_and_decode_in_one_step() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16)
    a, b = make_requests(2, 4, 5)[0], make_requests(1, 30, 5, first_id=1)[0]
    scheduler.add_request(a)
    step(scheduler)
    scheduler.add_request(b)
    out, updated = step(scheduler)
    assert num_tokens_by_id(out) == {"r0": 1, "r1": 15}  # running first, then the chunk
    assert [s.sample for s in out.scheduled] == [True, False]
    assert updated == [a]
    out, updated = step(scheduler)
    assert num_tokens_by_id(out) == {"r0": 1, "r1": 15}
    assert [s.sample for s in out.scheduled] == [True, True]
    assert updated == [a, b]


def test_token_budget_and_seat_limit() -> None:
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=8)
    add_all(scheduler, make_requests(3, 3, 2))
    out, _ = step(scheduler)
    assert num_tokens_by_id(out) == {"r0": 3, "r1": 3}  # no seat for r2
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)
    out, _ = step(scheduler)
    assert num_tokens_by_id(out) == {"r0": 1, "r1": 1}
    out, _ = step(scheduler)
    assert num_tokens_by_id(out) == {"r2": 3}


def test_no_admission_once_the_budget_is_spent() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4)
    add_all(scheduler, make_requests(4, 1, 3))
    step(scheduler)
    out, _ = step(scheduler)
    assert scheduled_ids(out) == ["r0", "r1", "r2", "r3"]
    scheduler.add_request(make_requests(1, 5, 1, first_id=9)[0])
    out, _ = step(scheduler)
    assert scheduled_ids(out) == ["r0", "r1", "r2", "r3"]  # no budget left to admit r9


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_admission_stops_at_the_first_request_that_does_not_fit(policy: str) -> None:
    scheduler = make_scheduler(policy=policy, num_blocks=8)
    (a,) = make_requests(1, 16, 4)  # 4 blocks
    (b,) = make_requests(1, 24, 4, first_id=1, first_arrival=1)  # 6 blocks: no room left
    (c,) = make_requests(1, 4, 4, first_id=2, first_arrival=2)  # 1 block would fit
    add_all(scheduler, [a, b, c])
    out, _ = step(scheduler)
    assert scheduled_ids(out) == ["r0"]  # c does not overtake b (it would starve b)
    assert out.preempted_ids == []
    assert [r.request_id for r in scheduler.waiting] == ["r1", "r2"]  # b parked, put back
    assert len(scheduler.skipped_waiting) == 0


def test_fcfs_admits_in_arrival_order_ignoring_priority() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    add_all(scheduler, make_requests(3, 4, 1, priorities=[5, 0, -3]))
    order = [scheduled_ids(out)[0] for out in run_until_done(scheduler)]
    assert order == ["r0", "r1", "r2"]


def test_priority_admits_most_urgent_first_ties_by_arrival() -> None:
    scheduler = make_scheduler(policy="priority", max_num_seqs=1)
    add_all(scheduler, make_requests(4, 4, 1, priorities=[2, 0, 1, 0]))
    order = [scheduled_ids(out)[0] for out in run_until_done(scheduler)]
    assert order == ["r1", "r3", "r2", "r0"]


def test_update_returns_only_requests_that_got_a_token() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10)
    a, b = make_requests(2, 6, 3)
    add_all(scheduler, [a, b])
    out, updated = step(scheduler)
    assert num_tokens_by_id(out) == {"r0": 6, "r1": 4}
    assert updated == [a]


def test_logprobs_are_appended() -> None:
    scheduler = make_scheduler()
    (r,) = make_requests(1, 4, 2)
    scheduler.add_request(r)
    out = scheduler.schedule()
    scheduler.update(out, make_runner_output(out, with_logprobs=True))
    assert len(r.output_logprobs) == 1 and r.output_logprobs[0].logprob == -0.5


def test_runner_without_a_token_for_a_sampling_request_is_an_error() -> None:
    scheduler = make_scheduler()
    add_all(scheduler, make_requests(1, 4, 2))
    out = scheduler.schedule()
    with pytest.raises(ValueError, match="no token"):
        scheduler.update(out, ModelRunnerOutput())


# ---- preemption when a running request needs a block ----


def test_fcfs_preemption_picks_latest_admitted() -> None:
    scheduler = make_scheduler(num_blocks=6)
    requests = make_requests(3, 7, 10)
    add_all(scheduler, requests)
    step(scheduler)  # 3 x 2 blocks: the pool is full
    step(scheduler)  # token 8 still fits in block 2
    out, _ = step(scheduler)  # r0 then r1 need a third block
    r2 = requests[2]
    assert out.preempted_ids == ["r2"]
    assert scheduled_ids(out) == ["r0", "r1"]
    assert r2.status is RequestStatus.PREEMPTED
    assert (r2.num_computed_tokens, r2.num_preemptions, r2.num_output_tokens) == (0, 1, 2)
    assert scheduler.kv_cache.get_block_ids("r2") == []
    assert next(iter(scheduler.waiting)) is r2
    assert scheduler.stats.num_preemptions_total == 1
    run_until_done(scheduler)
    assert {r.request_id: r.output_token_ids for r in requests} == undisturbed_outputs(requests)


def test_priority_preemption_picks_lowest_priority() -> None:
    scheduler = make_scheduler(policy="priority", num_blocks=6)
    requests = make_requests(3, 7, 10, priorities=[2, 0, 1])
    scheduler.add_request(requests[0])
    step(scheduler)
    add_all(scheduler, requests[1:])  # admitted one level a step: r1, then r2
    out, _ = step(scheduler)
    while not out.preempted_ids:
        out, _ = step(scheduler)
    assert out.preempted_ids == ["r0"]  # FCFS would have picked r2, the latest admitted
    assert scheduled_ids(out) == ["r1", "r2"]
    run_until_done(scheduler)
    assert all(r.num_output_tokens == 10 for r in requests)
    assert requests[0].num_preemptions >= 1


def test_priority_preemption_ties_by_latest_arrival() -> None:
    scheduler = make_scheduler(policy="priority", num_blocks=6)
    add_all(scheduler, make_requests(3, 7, 10, priorities=[1, 1, 1]))
    step(scheduler)
    step(scheduler)
    out, _ = step(scheduler)
    assert out.preempted_ids == ["r2"]


@pytest.mark.parametrize(
    ("policy", "priorities", "prompt_lens"),
    [
        ("priority", [1, 0], [8, 5]),  # r0 is the worst priority and needs the block
        ("fcfs", [0, 0], [5, 8]),  # r1 is the latest admitted and needs the block
    ],
)
def test_victim_can_be_the_request_itself(
    policy: str, priorities: list[int], prompt_lens: list[int]
) -> None:
    scheduler = make_scheduler(policy=policy, num_blocks=4)
    requests = [
        make_requests(1, n, 8, priorities=[p], first_id=i, first_arrival=float(i))[0]
        for i, (n, p) in enumerate(zip(prompt_lens, priorities, strict=True))
    ]
    add_all(scheduler, requests)
    out, _ = step(scheduler)
    while not out.preempted_ids:  # under priority r0 joins a step after r1: one level a step
        out, _ = step(scheduler)
    needy = "r0" if policy == "priority" else "r1"
    other = "r1" if needy == "r0" else "r0"
    assert out.preempted_ids == [needy]
    assert scheduled_ids(out) == [other]
    run_until_done(scheduler)
    assert all(r.num_output_tokens == 8 for r in requests)


def test_preemption_step_admits_nobody() -> None:
    scheduler = make_scheduler(num_blocks=6)
    add_all(scheduler, make_requests(3, 7, 10))
    step(scheduler)
    step(scheduler)
    scheduler.add_request(make_requests(1, 1, 1, first_id=5)[0])
    out, _ = step(scheduler)
    assert out.preempted_ids == ["r2"]
    assert "r5" not in scheduled_ids(out)


def test_preemption_step_admits_only_requests_more_urgent_than_its_victims() -> None:
    """Under priority, a full pool that preempts every step must not keep an urgent
    request waiting: it is admitted in the preempting step; a request no better than the
    victim is not."""
    scheduler = make_scheduler(policy="priority", num_blocks=8)
    running = make_requests(3, 7, 10, priorities=[5, 5, 5])
    add_all(scheduler, running)
    step(scheduler)  # 3 x 2 blocks of 8
    step(scheduler)  # token 8 still fits in block 2
    (urgent,) = make_requests(1, 3, 4, priorities=[0], first_id=10, first_arrival=10)
    (lax,) = make_requests(1, 3, 4, priorities=[9], first_id=11, first_arrival=11)
    add_all(scheduler, [urgent, lax])
    out, _ = step(scheduler)  # r0 and r1 take the 2 free blocks; r2 preempts itself
    assert out.preempted_ids == ["r2"]
    assert scheduled_ids(out) == ["r0", "r1", "r10"]
    assert lax.status is RequestStatus.WAITING
    run_until_done(scheduler)
    requests = [*running, urgent, lax]
    assert {r.request_id: r.output_token_ids for r in requests} == undisturbed_outputs(requests)


# ---- priority admission ----


def priority_setup(running_priority: int, new_priority: int) -> tuple[Scheduler, Request, Request]:
    """r0 running (12-token prompt: 3 of 4 blocks, all 4 once it decodes) and r1 waiting
    (6 tokens: 2 blocks)."""
    scheduler = make_scheduler(policy="priority", num_blocks=4)
    (r0,) = make_requests(1, 12, 4, priorities=[running_priority])
    scheduler.add_request(r0)
    step(scheduler)
    (r1,) = make_requests(1, 6, 2, priorities=[new_priority], first_id=1, first_arrival=10)
    scheduler.add_request(r1)
    return scheduler, r0, r1


def test_priority_admission_preempts_strictly_worse() -> None:
    scheduler, r0, r1 = priority_setup(running_priority=5, new_priority=0)
    out, _ = step(scheduler)
    assert out.preempted_ids == ["r0"]
    assert scheduled_ids(out) == ["r1"]  # r0's decode was taken back out of the batch
    assert out.num_scheduled_tokens == 6
    assert r0.status is RequestStatus.PREEMPTED and r0.num_output_tokens == 1
    run_until_done(scheduler)
    assert r0.num_output_tokens == 4 and r1.num_output_tokens == 2


@pytest.mark.parametrize(("running_priority", "new_priority"), [(0, 0), (0, 3)])
def test_priority_admission_never_preempts_equal_or_better(
    running_priority: int, new_priority: int
) -> None:
    scheduler, r0, r1 = priority_setup(running_priority, new_priority)
    out, _ = step(scheduler)
    assert out.preempted_ids == []
    assert scheduled_ids(out) == ["r0"]
    assert r1.status is RequestStatus.WAITING
    run_until_done(scheduler)
    assert r0.num_preemptions == 0


def test_priority_admission_does_not_preempt_in_vain() -> None:
    scheduler = make_scheduler(policy="priority", num_blocks=4)
    add_all(scheduler, make_requests(2, 7, 5, priorities=[0, 5]))  # 2 blocks each
    step(scheduler)
    (new,) = make_requests(1, 12, 1, priorities=[1], first_id=2, first_arrival=5)
    scheduler.add_request(new)
    out, _ = step(scheduler)
    assert out.preempted_ids == []  # freeing r1 (2 blocks) cannot make room for 3
    assert new.status is RequestStatus.WAITING


def test_priority_admission_preempts_for_a_seat() -> None:
    scheduler = make_scheduler(policy="priority", max_num_seqs=1)
    (low,) = make_requests(1, 4, 10, priorities=[3])
    scheduler.add_request(low)
    step(scheduler)
    (high,) = make_requests(1, 4, 1, priorities=[0], first_id=1, first_arrival=1)
    scheduler.add_request(high)
    out, _ = step(scheduler)
    assert out.preempted_ids == ["r0"] and scheduled_ids(out) == ["r1"]


def test_priority_admission_preempts_worst_first_and_only_as_needed() -> None:
    scheduler = make_scheduler(policy="priority", num_blocks=4, block_size=16)
    running = make_requests(3, 7, 10, priorities=[1, 3, 2])  # a block each
    add_all(scheduler, running)
    for _ in range(3):  # one level a step
        step(scheduler)
    assert scheduler.num_running == 3
    (new,) = make_requests(1, 20, 1, priorities=[0], first_id=3, first_arrival=5)  # 2 blocks
    scheduler.add_request(new)
    out, _ = step(scheduler)
    assert out.preempted_ids == ["r1"]
    assert set(scheduled_ids(out)) == {"r0", "r2", "r3"}


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
        low.priority_bound = bound
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


# ---- resume after preemption ----


def test_resume_reuses_prefix_cached_blocks_and_same_tokens() -> None:
    scheduler, r0, r1 = priority_setup(running_priority=5, new_priority=0)
    out, _ = step(scheduler)
    assert out.preempted_ids == ["r0"]
    resumed: list[ScheduledRequest] = []
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler)
        resumed += [s for s in out.scheduled if s.request_id == "r0"]
    # r0's first two blocks survived in the prefix cache (r1 took the other two), so it
    # recomputes tokens 8..12 (prompt tail and its one output), then decodes on.
    assert [(s.num_computed_tokens, s.num_new_tokens) for s in resumed] == [
        (8, 5),
        (13, 1),
        (14, 1),
    ]
    for s in resumed:
        assert s.token_ids == r0.all_token_ids[s.num_computed_tokens : s.context_len]
    assert scheduler.stats.prefix_cache_hits_tokens == 8
    assert {"r0": r0.output_token_ids, "r1": r1.output_token_ids} == undisturbed_outputs(
        [r0, r1]
    )


def test_prefix_shared_between_requests() -> None:
    scheduler = make_scheduler()
    prefix = list(range(1, 9))
    a, b = make_requests(2, 10, 1, prefix=prefix)
    add_all(scheduler, [a, b])
    step(scheduler)  # admitted together: b cannot hit blocks a has not computed yet
    (c,) = make_requests(1, 12, 1, prefix=prefix, first_id=2)
    scheduler.add_request(c)
    out, _ = step(scheduler)
    (s,) = out.scheduled
    assert s.num_computed_tokens == 8 and s.token_ids == c.prompt_token_ids[8:]
    stats = scheduler.stats
    assert (stats.prefix_cache_queries_tokens, stats.prefix_cache_hits_tokens) == (32, 8)


# ---- abort and finish from outside ----


def test_abort_waiting_and_running() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    running, waiting = make_requests(2, 6, 10)
    add_all(scheduler, [running, waiting])
    step(scheduler)
    abort = RequestStatus.FINISHED_ABORTED
    assert scheduler.finish_requests(["r1", "nope"], abort) == [waiting]
    assert waiting.status is RequestStatus.FINISHED_ABORTED and waiting.finish_reason == "abort"
    assert scheduler.num_waiting == 0
    assert scheduler.finish_requests("r0", abort) == [running]
    assert scheduler.finish_requests(["r0"], abort) == []
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks
    assert "r0" not in scheduler.requests
    scheduler.check_integrity()
    out = scheduler.schedule()
    assert out.is_empty and out.finished_ids == ["r1", "r0"]
    assert scheduler.schedule().finished_ids == []


def test_abort_between_schedule_and_update() -> None:
    scheduler = make_scheduler()
    a, b = make_requests(2, 4, 3)
    add_all(scheduler, [a, b])
    out = scheduler.schedule()
    scheduler.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED)
    updated = scheduler.update(out, make_runner_output(out))
    assert updated == [b]
    assert a.num_output_tokens == 0
    scheduler.check_integrity()
    assert scheduler.schedule().finished_ids == ["r0"]


def test_finish_requests_for_a_stop_string() -> None:
    scheduler = make_scheduler()
    (r,) = make_requests(1, 4, 10)
    scheduler.add_request(r)
    step(scheduler)
    assert scheduler.finish_requests(["r0"], RequestStatus.FINISHED_STOPPED) == [r]
    assert r.finish_reason == "stop"
    assert scheduler.kv_cache.usage == 0.0
    with pytest.raises(ValueError):
        scheduler.finish_requests(["r0"], RequestStatus.RUNNING)


def test_finished_ids_reach_the_runner_once() -> None:
    scheduler = make_scheduler()
    add_all(scheduler, make_requests(2, 4, 1))
    out, updated = step(scheduler)
    assert out.finished_ids == [] and all(r.is_finished for r in updated)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule().finished_ids == ["r0", "r1"]
    assert scheduler.schedule().finished_ids == []


# ---- stop conditions ----


def test_eos_stops() -> None:
    scheduler = make_scheduler()
    (r,) = make_requests(1, 4, 10, ignore_eos=False, eos_token_ids=frozenset({EOS}))
    scheduler.add_request(r)
    step(scheduler)
    step(scheduler, lambda _s: EOS)
    assert r.status is RequestStatus.FINISHED_STOPPED
    assert r.output_token_ids[-1] == EOS and r.num_output_tokens == 2


def test_ignore_eos_runs_to_max_tokens() -> None:
    scheduler = make_scheduler()
    (r,) = make_requests(1, 4, 5, ignore_eos=True, eos_token_ids=frozenset({EOS}))
    scheduler.add_request(r)
    run_until_done(scheduler, lambda _s: EOS)
    assert r.status is RequestStatus.FINISHED_LENGTH_CAPPED and r.num_output_tokens == 5


@pytest.mark.parametrize("via", ["eos", "stop_token_ids"])
def test_min_tokens_delays_stop(via: str) -> None:
    scheduler = make_scheduler()
    (r,) = make_requests(
        1,
        4,
        10,
        ignore_eos=False,
        min_tokens=3,
        eos_token_ids=frozenset({EOS}) if via == "eos" else frozenset(),
        stop_token_ids=(EOS,) if via == "stop_token_ids" else (),
    )
    scheduler.add_request(r)
    run_until_done(scheduler, lambda _s: EOS)
    assert r.status is RequestStatus.FINISHED_STOPPED and r.num_output_tokens == 3


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    scheduler = make_scheduler()
    (r,) = make_requests(1, 4, 10, ignore_eos=True, stop_token_ids=(99,))
    scheduler.add_request(r)
    step(scheduler)
    step(scheduler, lambda _s: 99)
    assert r.status is RequestStatus.FINISHED_STOPPED and r.num_output_tokens == 2


def test_max_model_len_caps_length() -> None:
    scheduler = make_scheduler(max_model_len=12)
    (r,) = make_requests(1, 10, 100)
    scheduler.add_request(r)
    run_until_done(scheduler)
    assert r.status is RequestStatus.FINISHED_LENGTH_CAPPED and r.num_tokens == 12


# ---- admission limits ----


def test_add_request_rejects_what_can_never_run() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=100)
    assert scheduler.max_request_len == 16  # the pool, not max_model_len, is the limit
    with pytest.raises(ValueError, match="too long"):
        scheduler.add_request(make_requests(1, 16, 1)[0])
    with pytest.raises(ValueError, match="empty"):
        scheduler.add_request(Request("e", [], make_requests(1, 1, 1)[0].sampling_params))
    (ok,) = make_requests(1, 15, 5)
    scheduler.add_request(ok)
    with pytest.raises(ValueError, match="already"):
        scheduler.add_request(make_requests(1, 3, 1)[0])
    run_until_done(scheduler)
    assert ok.num_tokens == 16 and ok.finish_reason == "length"


def test_watermark_keeps_blocks_free_for_running_requests() -> None:
    scheduler = make_scheduler(num_blocks=10, watermark=0.2)  # 2 blocks reserved
    (a,) = make_requests(1, 20, 8)  # 5 blocks
    (b,) = make_requests(1, 12, 8, first_id=1)  # 3 blocks: exactly down to the reserve
    (c,) = make_requests(1, 4, 8, first_id=2)  # 1 block: would eat into the reserve
    add_all(scheduler, [a, b])
    out, _ = step(scheduler)
    assert scheduled_ids(out) == ["r0", "r1"]
    scheduler.add_request(c)
    out, _ = step(scheduler)
    assert scheduled_ids(out) == ["r0", "r1"]
    # Both running requests grew into the reserve: running requests may use it.
    assert scheduler.kv_cache.num_held_blocks("r0") == 6
    assert scheduler.kv_cache.num_held_blocks("r1") == 4
    assert scheduler.kv_cache.num_free_blocks == 0
    run_until_done(scheduler)
    assert c.num_output_tokens == 8


# ---- introspection ----


def test_snapshot_is_json_ready() -> None:
    scheduler = make_scheduler(policy="priority", max_num_seqs=1)
    add_all(scheduler, make_requests(2, 6, 4, priorities=[1, 0]))
    step(scheduler)
    snap = json.loads(json.dumps(scheduler.snapshot()))
    assert snap["policy"] == "priority"
    (running,) = snap["running"]
    assert running["request_id"] == "r1" and running["num_blocks"] == 2
    assert running["status"] == "RUNNING" and running["num_computed_tokens"] == 6
    assert [w["request_id"] for w in snap["waiting"]] == ["r0"]
    assert set(snap["waiting"][0]) >= {"priority", "arrival_time", "num_preemptions"}
    assert snap["kv_cache"] == {
        "num_blocks": 32,
        "num_free_blocks": 30,
        "num_cached_blocks": 1,
        "block_size": 4,
        "usage": pytest.approx(2 / 32),
    }


def test_stats_and_counts() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    add_all(scheduler, make_requests(2, 5, 2))
    assert scheduler.has_unfinished_requests()
    step(scheduler)
    stats = scheduler.stats
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 1)
    assert stats.num_blocks == 32 and stats.num_free_blocks == 30
    assert stats.kv_cache_usage == pytest.approx(2 / 32)
    assert stats.num_preemptions_total == 0
    assert "r1" in scheduler.requests


def test_fake_token_depends_only_on_request_and_position() -> None:
    # The resume tests rely on this.
    params = make_requests(1, 1, 1)[0].sampling_params
    chunk = ScheduledRequest("x", [1, 2], 3, [], True, params, [], [])
    decode = ScheduledRequest("x", [9], 4, [0], True, params, [], [])
    assert fake_token(chunk) == fake_token(decode)


def test_request_status_order_and_finish_reasons() -> None:
    finished = [s for s in RequestStatus if s.is_finished]
    assert finished == [
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_DEADLINE,
    ]
    assert all(s > RequestStatus.PREEMPTED for s in finished)
    assert [s.finish_reason for s in finished] == ["stop", "length", "abort", "deadline"]
    (r,) = make_requests(1, 3, 1)
    assert (r.status, r.is_finished, r.finish_reason) == (RequestStatus.WAITING, False, None)
    assert (r.num_tokens, r.all_token_ids) == (3, r.prompt_token_ids)


# ---- one order for the budget ----


def test_decodes_go_before_a_more_urgent_prefill() -> None:
    """A 320-token priority-0 prompt on a 64-token budget: the 8 priority-5 decodes still
    get their token every step; the prompt takes what is left."""
    scheduler = make_scheduler(policy="priority", num_blocks=256, max_model_len=512)
    low = make_requests(8, 4, 30, priorities=[5] * 8)
    add_all(scheduler, low)
    step(scheduler)
    (urgent,) = make_requests(1, 320, 2, priorities=[0], first_id=8, first_arrival=10)
    scheduler.add_request(urgent)
    for _ in range(7):  # 320 = 5 x 56 + 40, then one decode
        out, _ = step(scheduler)
        tokens = num_tokens_by_id(out)
        assert all(tokens[r.request_id] == 1 for r in low)
        if tokens["r8"] > 1:
            assert scheduled_ids(out) == [*(r.request_id for r in low), "r8"]  # decodes first
        if urgent.num_output_tokens == 0:
            assert tokens["r8"] == 56
    assert urgent.num_output_tokens == 2


def test_waiting_request_goes_before_a_worse_running_chunk() -> None:
    scheduler = make_scheduler(policy="priority", max_num_batched_tokens=8, num_blocks=64)
    (low,) = make_requests(1, 40, 2, priorities=[5])
    scheduler.add_request(low)
    out, _ = step(scheduler)
    assert num_tokens_by_id(out) == {"r0": 8}
    (urgent,) = make_requests(1, 6, 2, priorities=[-10], first_id=1, first_arrival=5)
    scheduler.add_request(urgent)
    out, _ = step(scheduler)
    # before: low's chunk took the whole budget. Nor does it ride along: the step of an
    # urgent prompt carries no worse prefill, so that its first token comes sooner.
    assert num_tokens_by_id(out) == {"r1": 6}
    out, _ = step(scheduler)
    assert num_tokens_by_id(out) == {"r1": 1, "r0": 7}


def test_fcfs_keeps_running_chunks_before_admissions() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8, num_blocks=64)
    (first,) = make_requests(1, 40, 2)
    scheduler.add_request(first)
    step(scheduler)
    scheduler.add_request(make_requests(1, 6, 1, first_id=1, first_arrival=5)[0])
    out, _ = step(scheduler)
    assert num_tokens_by_id(out) == {"r0": 8}


def test_prefills_beside_decodes_take_the_threshold_or_two_tokens_per_request_in_all() -> None:
    def make() -> Scheduler:
        return make_scheduler(
            policy="priority", max_num_batched_tokens=256, num_blocks=256, max_num_seqs=32,
            long_prefill_token_threshold=16,
        )

    lone = make()
    lone.add_request(make_requests(1, 40, 1)[0])
    out, _ = step(lone)
    assert num_tokens_by_id(out) == {"r0": 40}  # it delays nobody: no cap

    # one decode and two prompts (a batch of 3): 16 prefill tokens a step in all (before:
    # 16 for each prompt, so that many prompts made as long a step as one long one)
    scheduler = make()
    scheduler.add_request(make_requests(1, 4, 10, priorities=[5])[0])
    step(scheduler)
    add_all(scheduler, make_requests(2, 40, 1, priorities=[0, 0], first_id=1, first_arrival=1))
    for expected in ({"r1": 16}, {"r1": 16}, {"r1": 8, "r2": 8}, {"r2": 16}, {"r2": 16}):
        out, _ = step(scheduler)
        assert num_tokens_by_id(out) == {"r0": 1, **expected}

    # twenty decodes and a 200-token prompt (a batch of 21): 42 prefill tokens a step (fewer
    # from context 42 on: a token's attention over a longer context counts for a little more)
    scheduler = make()
    add_all(scheduler, make_requests(20, 4, 10, priorities=[5] * 20))
    step(scheduler)
    scheduler.add_request(make_requests(1, 200, 1, priorities=[0], first_id=20)[0])
    for expected in (42, 41, 40, 40, 37):
        out, _ = step(scheduler)
        tokens = num_tokens_by_id(out)
        assert tokens.pop("r20") == expected
        assert list(tokens.values()) == [1] * 20


def test_a_prompt_just_over_the_room_goes_whole_and_a_longer_one_is_split() -> None:
    # 48 decodes and a prompt (a batch of 49: room for 98): a 128-token prompt (cost 132,
    # within 1.5 x 98) goes in one step instead of 96 + 32 (its first token would wait a
    # whole step more for 32 tokens); a 160-token one (cost 166) is split.
    for length, first_chunk in ((128, 128), (160, 96)):
        scheduler = make_scheduler(
            policy="priority", max_num_batched_tokens=512, num_blocks=1024, max_num_seqs=64,
            long_prefill_token_threshold=16,
        )
        add_all(scheduler, make_requests(48, 4, 10, priorities=[5] * 48))
        step(scheduler)
        scheduler.add_request(make_requests(1, length, 1, priorities=[0], first_id=48)[0])
        out, _ = step(scheduler)
        tokens = num_tokens_by_id(out)
        assert tokens.pop("r48") == first_chunk
        assert list(tokens.values()) == [1] * 48


def test_a_long_prompt_takes_fewer_tokens_a_step_as_its_context_grows() -> None:
    scheduler = make_scheduler(
        policy="priority", max_num_batched_tokens=512, num_blocks=2048,
        long_prefill_token_threshold=64, max_model_len=8192,
    )
    scheduler.add_request(make_requests(1, 4, 1000, priorities=[5])[0])
    step(scheduler)
    scheduler.add_request(make_requests(1, 4000, 1, priorities=[0], first_id=1)[0])
    chunks = []  # (start, size)
    while "r1" in scheduler.requests:
        start = scheduler.requests["r1"].num_computed_tokens
        out, _ = step(scheduler)
        chunks.append((start, num_tokens_by_id(out)["r1"]))
    context = scheduler.config.attention_cost_context
    assert context == 2048
    assert all(prefill_cost(start, size, context) <= 64 for start, size in chunks[:-1])
    sizes = [size for _, size in chunks[:-1]]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == 63
    at_2048 = next(size for start, size in chunks if start >= context)
    assert at_2048 <= 33  # a token at context 2,048 counts for two


def test_a_burst_is_admitted_at_the_rate_of_the_batch_it_makes() -> None:
    # One decode, then 15 prompts of 8 tokens: the batch of 16 allows 32 prefill tokens a
    # step from the first, not the 16 (or 2 per decode) that its one decode would.
    scheduler = make_scheduler(
        policy="priority", max_num_batched_tokens=256, num_blocks=256,
        long_prefill_token_threshold=16,
    )
    scheduler.add_request(make_requests(1, 4, 20, priorities=[5])[0])
    step(scheduler)
    add_all(scheduler, make_requests(15, 8, 4, first_id=1, first_arrival=1))
    out, _ = step(scheduler)
    assert sum(n for n in num_tokens_by_id(out).values() if n > 1) == 32


# ---- n > 1 ----


@pytest.mark.parametrize("caching", [True, False])
def test_choices_compute_the_prompt_once_and_share_its_blocks(caching: bool) -> None:
    scheduler = make_scheduler(
        policy="priority", num_blocks=64, max_num_batched_tokens=64,
        enable_prefix_caching=caching,
    )
    prompt = list(range(100, 140))  # 40 tokens: 9 full blocks a choice can share, of 4
    params = make_requests(1, 1, 3)[0].sampling_params
    choices = [
        Request(f"c-{i}", prompt, params, prompt_leader_id="c-0" if i else None,
                arrival_time=0.0)
        for i in range(8)
    ]
    add_all(scheduler, choices)
    assert scheduler.num_waiting == 8 and len(scheduler.waiting) == 1  # 7 held back
    out, _ = step(scheduler)
    assert num_tokens_by_id(out) == {"c-0": 40}
    out, _ = step(scheduler)
    tokens = num_tokens_by_id(out)
    assert tokens.pop("c-0") == 1
    assert tokens == {f"c-{i}": 4 for i in range(1, 8)}  # the last, partial block each
    assert all(c.num_cached_tokens == 36 for c in choices[1:])
    leader_blocks = scheduler.kv_cache.get_block_ids("c-0")
    for c in choices[1:]:
        assert scheduler.kv_cache.get_block_ids(c.request_id)[:9] == leader_blocks[:9]
    # one prompt's worth (10 blocks, 11 with the leader's decode) plus one partial block
    # per sibling
    assert scheduler.kv_cache.num_blocks - scheduler.kv_cache.num_free_blocks == 11 + 7
    if caching:
        assert scheduler.kv_cache.prefix_cache_hits_tokens == 7 * 36
    run_until_done(scheduler)
    assert all(c.num_output_tokens == 3 for c in choices)


def test_choices_go_on_when_their_leader_is_aborted() -> None:
    scheduler = make_scheduler(num_blocks=64, enable_prefix_caching=False)
    prompt = list(range(100, 140))
    params = make_requests(1, 1, 2)[0].sampling_params
    leader = Request("c-0", prompt, params)
    sibling = Request("c-1", prompt, params, prompt_leader_id="c-0")
    add_all(scheduler, [leader, sibling])
    scheduler.finish_requests(["c-0"], RequestStatus.FINISHED_ABORTED)
    scheduler.check_integrity()
    run_until_done(scheduler)
    assert sibling.num_output_tokens == 2 and sibling.num_cached_tokens == 0


def test_held_choice_can_be_aborted() -> None:
    scheduler = make_scheduler(num_blocks=64)
    prompt = list(range(100, 140))
    params = make_requests(1, 1, 2)[0].sampling_params
    leader = Request("c-0", prompt, params)
    sibling = Request("c-1", prompt, params, prompt_leader_id="c-0")
    add_all(scheduler, [leader, sibling])
    assert scheduler.finish_requests(["c-1"], RequestStatus.FINISHED_ABORTED) == [sibling]
    scheduler.check_integrity()
    run_until_done(scheduler)
    assert leader.num_output_tokens == 2 and sibling.finish_reason == "abort"


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


# ---- costs that do not grow with the queue ----


def test_finishing_a_running_request_leaves_waiting_untouched() -> None:
    scheduler = make_scheduler(policy="priority", max_num_seqs=1, num_blocks=512)
    add_all(scheduler, make_requests(50, 4, 2, priorities=[i % 5 for i in range(50)]))
    step(scheduler)
    (running,) = scheduler.running
    waiting = scheduler.waiting
    before = list(waiting)
    entries_before = waiting._num_entries()
    scheduler.finish_requests(
        [running.request_id, before[3].request_id], RequestStatus.FINISHED_ABORTED
    )
    assert list(waiting) == [r for r in before if r is not before[3]]
    assert waiting._num_entries() == entries_before  # lazily dropped, nothing rebuilt
    scheduler.check_integrity()


def test_snapshot_caps_the_waiting_list() -> None:
    scheduler = make_scheduler(policy="priority", max_num_seqs=1, num_blocks=512)
    add_all(scheduler, make_requests(50, 4, 2, priorities=[i % 5 for i in range(50)]))
    step(scheduler)
    snap = scheduler.snapshot(max_waiting=10)
    assert snap["num_waiting"] == 49
    assert [w["request_id"] for w in snap["waiting"]] == [
        r.request_id for r in list(scheduler.waiting)[:10]
    ]


def test_stats_count_by_priority() -> None:
    scheduler = make_scheduler(policy="priority", max_num_seqs=2, num_blocks=6)
    add_all(scheduler, make_requests(4, 7, 6, priorities=[3, 3, 1, 3]))
    step(scheduler)  # r2 (level 1), then r0 (level 3) a step later
    step(scheduler)
    stats = scheduler.stats
    assert stats.num_running_by_priority == {1: 1, 3: 1}
    assert stats.num_waiting_by_priority == {3: 2}
    run_until_done(scheduler)
    assert sum(scheduler.stats.num_preemptions_by_priority.values()) == (
        scheduler.num_preemptions_total
    )
