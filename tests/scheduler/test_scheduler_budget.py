"""One order for each step's token budget: decodes first, then prefill work in policy
order, and the prefill cap beside decodes (scheduler/budget.py) with its knobs."""

from __future__ import annotations

from typing import Any

import pytest

from kvcache.config import CacheConfig
from scheduler.budget import prefill_cost
from scheduler.config import SchedulerConfig
from scheduler.scheduler import Scheduler
from tests.support.scheduler_helpers import (
    FakeClock,
    add_all,
    make_requests,
    make_scheduler,
    num_tokens_by_id,
    scheduled_ids,
    step,
)


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


# ---- the tuning knobs ----


def tuned(**knobs: Any) -> Scheduler:
    """A priority scheduler with the prefill cap on (threshold 16) and tuning `knobs`."""
    config = SchedulerConfig(
        policy="priority", max_num_batched_tokens=512, max_num_seqs=64, max_model_len=8192,
        long_prefill_token_threshold=16, **knobs,
    )
    return Scheduler(config, CacheConfig(num_blocks=2048, block_size=4), clock=FakeClock())


def test_tuning_knobs_default_to_what_was_measured() -> None:
    config = SchedulerConfig()
    assert config.prefill_tokens_per_request == 2
    assert config.whole_prompt_slack == 1.5
    assert config.attention_cost_context == 2048


@pytest.mark.parametrize("knob", [
    {"prefill_tokens_per_request": -1},
    {"whole_prompt_slack": 0.9},
    {"whole_prompt_slack": float("nan")},
    {"attention_cost_context": 0},
])
def test_tuning_knobs_are_validated(knob: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(knob))):
        SchedulerConfig(**knob)


@pytest.mark.parametrize(("per_request", "chunks"), [(2, [42, 41]), (4, [83, 80]), (0, [16, 16])])
def test_prefill_tokens_per_request_sets_the_cap_per_request_of_the_batch(
    per_request: int, chunks: list[int]
) -> None:
    # twenty decodes and a 200-token prompt: a batch of 21 (0: the threshold alone)
    scheduler = tuned(prefill_tokens_per_request=per_request)
    add_all(scheduler, make_requests(20, 4, 10, priorities=[5] * 20))
    step(scheduler)
    scheduler.add_request(make_requests(1, 200, 1, priorities=[0], first_id=20)[0])
    assert [num_tokens_by_id(step(scheduler)[0])["r20"] for _ in chunks] == chunks


@pytest.mark.parametrize(("slack", "length", "first_chunk"), [
    (1.5, 128, 128), (1.5, 160, 96), (1.0, 128, 96), (2.0, 160, 160),
])
def test_whole_prompt_slack_sets_which_prompts_go_whole(
    slack: float, length: int, first_chunk: int
) -> None:
    # 48 decodes and a prompt: room for 98 prefill tokens
    scheduler = tuned(whole_prompt_slack=slack)
    add_all(scheduler, make_requests(48, 4, 10, priorities=[5] * 48))
    step(scheduler)
    scheduler.add_request(make_requests(1, length, 1, priorities=[0], first_id=48)[0])
    out, _ = step(scheduler)
    assert num_tokens_by_id(out)["r48"] == first_chunk


def test_attention_cost_context_sets_what_a_token_at_a_long_context_counts_for() -> None:
    scheduler = tuned(attention_cost_context=256)
    scheduler.add_request(make_requests(1, 4, 1000, priorities=[5])[0])
    step(scheduler)
    scheduler.add_request(make_requests(1, 1000, 1, priorities=[0], first_id=1)[0])
    chunks = []  # (start, size)
    while "r1" in scheduler.requests:
        start = scheduler.requests["r1"].num_computed_tokens
        out, _ = step(scheduler)
        chunks.append((start, num_tokens_by_id(out)["r1"]))
    assert all(prefill_cost(start, size, 256) <= 16 for start, size in chunks[:-1])
    assert chunks[:2] == [(0, 16), (16, 15)]  # (16, 16) at the default 2048
    assert chunks[-2][1] == 3  # a token at context ~1,000 counts for ~5


def test_decodes_of_the_background_class_do_not_cap_an_urgent_prompt() -> None:
    """Batch lines (priority 100, the background class) decoding: an urgent 120-token
    prompt goes whole in its first step; one interactive decode beside them (priority 5)
    brings the cap back, so the prompt goes in capped chunks."""
    def run(priorities: list[int]) -> int:
        scheduler = make_scheduler(
            policy="priority", max_num_batched_tokens=256, num_blocks=256, max_num_seqs=32,
            max_model_len=512, long_prefill_token_threshold=16, background_priority=100,
        )
        decoding = make_requests(len(priorities), 4, 30, priorities=priorities)
        add_all(scheduler, decoding)
        while any(r.num_output_tokens == 0 for r in decoding):
            step(scheduler)
        (urgent,) = make_requests(1, 120, 2, priorities=[0], first_id=len(priorities),
                                  first_arrival=10)
        scheduler.add_request(urgent)
        out, _ = step(scheduler)
        tokens = num_tokens_by_id(out)
        assert all(tokens[f"r{i}"] == 1 for i in range(len(priorities)))  # decodes first
        return tokens[urgent.request_id]

    assert run([100] * 8) == 120
    assert run([100] * 7 + [5]) == 18  # the cap: max(threshold 16, 2 tokens x 9 requests)
