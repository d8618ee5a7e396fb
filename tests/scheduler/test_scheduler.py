"""Scheduler behaviour, driven by hand-made runner outputs (no model): the basic flow
of a request, stop conditions and admission limits."""

from __future__ import annotations

import pytest

from scheduler.output import ModelRunnerOutput
from scheduler.request import Request, RequestStatus
from tests.support.scheduler_helpers import (
    add_all,
    make_requests,
    make_runner_output,
    make_scheduler,
    num_tokens_by_id,
    run_until_done,
    scheduled_ids,
    step,
)

EOS = 2


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


def test_request_status_order_and_finish_reasons() -> None:
    finished = [s for s in RequestStatus if s.is_finished]
    assert finished == [
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_DEADLINE,
        RequestStatus.FINISHED_REJECTED,
    ]
    assert all(s > RequestStatus.PREEMPTED for s in finished)
    assert [s.finish_reason for s in finished] == ["stop", "length", "abort", "deadline",
                                                   "rejected"]
    (r,) = make_requests(1, 3, 1)
    assert (r.status, r.is_finished, r.finish_reason) == (RequestStatus.WAITING, False, None)
    assert (r.num_tokens, r.all_token_ids) == (3, r.prompt_token_ids)


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
