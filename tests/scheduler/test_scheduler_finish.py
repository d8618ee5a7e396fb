"""Requests finished from outside (aborts, stop strings) at any point of their life, and
what that costs the waiting queue."""

from __future__ import annotations

import pytest

from scheduler.request import RequestStatus
from tests.support.scheduler_helpers import (
    add_all,
    make_requests,
    make_runner_output,
    make_scheduler,
    step,
)

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
