"""Preemption: of the latest admitted or the lowest priority when a running request
needs a block, priority admission by preempting strictly worse requests, and resume
with the same tokens (recompute)."""

from __future__ import annotations

import pytest

from scheduler.output import ScheduledRequest
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler
from tests.support.scheduler_helpers import (
    add_all,
    fake_token,
    make_requests,
    make_scheduler,
    run_until_done,
    scheduled_ids,
    step,
)


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


def test_fake_token_depends_only_on_request_and_position() -> None:
    # The resume tests rely on this.
    params = make_requests(1, 1, 1)[0].sampling_params
    chunk = ScheduledRequest("x", [1, 2], 3, [], True, params, [], [])
    decode = ScheduledRequest("x", [9], 4, [0], True, params, [], [])
    assert fake_token(chunk) == fake_token(decode)
