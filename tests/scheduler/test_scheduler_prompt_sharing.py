"""n > 1: the choices of a request compute the prompt once and share its blocks."""

from __future__ import annotations

import pytest

from scheduler.request import Request, RequestStatus
from tests.support.scheduler_helpers import (
    add_all,
    make_requests,
    make_scheduler,
    num_tokens_by_id,
    run_until_done,
    step,
)


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
