"""Speculative decoding in the scheduler, with hand-made runner outputs: n-gram proposals,
who gets drafts (priority, budgets, per-request limits), what a verified step leaves
(tokens up to a stop, progress rolled back, only accepted blocks keyed), no leaks."""

from __future__ import annotations

import random

import pytest

from scheduler.config import SpeculativeConfig
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.placement import Placement
from scheduler.request import Request, RequestStatus
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.speculation import propose_ngram
from tests.support.scheduler_helpers import make_runner_output, make_scheduler

PATTERN = [5, 6, 7, 8, 9, 10, 11, 12]  # a prompt that repeats it proposes what followed


def spec_scheduler(k: int = 4, max_num_verify_tokens: int = 32, **kw) -> Scheduler:
    return make_scheduler(
        speculative=SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=3,
                                      prompt_lookup_min=2,
                                      max_num_verify_tokens=max_num_verify_tokens),
        **kw,
    )


def copying(request_id: str, priority: int = 0, max_tokens: int = 32,
            **params) -> Request:
    """A request whose context repeats PATTERN: after its prompt and first output token
    (PATTERN[0]), the n-gram proposes PATTERN[1:]."""
    return Request(request_id, PATTERN * 2,
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params),
                   placement=Placement(priority=priority), arrival_time=float(priority))


def successor(token_id: int) -> int:
    """The token after `token_id` in PATTERN, cyclically (99 after any other)."""
    return PATTERN[(PATTERN.index(token_id) + 1) % len(PATTERN)] if token_id in PATTERN else 99


def verified(out: SchedulerOutput, num_accepted: dict[str, int] | None = None,
             next_token: int | None = None) -> ModelRunnerOutput:
    """A runner's answer: each drafted request accepts `num_accepted[id]` drafts (all by
    default), then gets `next_token`, as the others that sample do (by default the
    successor of the token before: the context goes on repeating PATTERN)."""
    runner_output = ModelRunnerOutput()
    for s in out.scheduled:
        if not s.sample:
            continue
        n = (num_accepted or {}).get(s.request_id, s.num_draft_tokens)
        accepted = s.draft_token_ids[:n]
        last = accepted[-1] if accepted else s.token_ids[len(s.token_ids) - s.num_draft_tokens - 1]
        token_id = successor(last) if next_token is None else next_token
        if s.num_draft_tokens:
            runner_output.verified_token_ids[s.request_id] = [*accepted, token_id]
        else:
            runner_output.sampled_token_ids[s.request_id] = token_id
    return runner_output


def to_decode(scheduler: Scheduler, *requests: Request) -> None:
    """Add `requests` and step until each has its first token (PATTERN's first, after a
    prompt of PATTERN * 2), the contexts repeating PATTERN."""
    for request in requests:
        scheduler.add_request(request)
    while any(not r.output_token_ids for r in requests):
        out = scheduler.schedule()
        scheduler.update(out, verified(out))


def test_ngram_proposes_what_followed_the_most_recent_match() -> None:
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 2, 3, 2, 100) == [8, 1]
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2], 10, 3, 2, 100) == [3, 4, 5, 1, 2]
    # the longest n first: [7, 1, 2] matches at 0, though [1, 2] matched later
    assert propose_ngram([7, 1, 2, 5, 0, 1, 2, 6, 7, 1, 2], 1, 3, 2, 100) == [5]
    assert propose_ngram([1, 2, 3, 4], 3, 3, 2, 100) == []  # no earlier occurrence
    assert propose_ngram([1, 2, 1], 3, 3, 2, 100) == []  # shorter than lookup_min matches
    # only the last `window` tokens are searched
    assert propose_ngram([1, 2, 8, 0, 0, 0, 1, 2], 1, 2, 2, 100) == [8]
    assert propose_ngram([1, 2, 8, 0, 0, 0, 1, 2], 1, 2, 2, 5) == []


def test_a_verified_step_appends_the_accepted_drafts_and_rolls_back_the_rest() -> None:
    scheduler = spec_scheduler(block_size=4)
    request = copying("r0")
    to_decode(scheduler, request)
    out = scheduler.schedule()
    (s,) = out.scheduled
    assert s.num_draft_tokens == 4 and s.draft_token_ids == PATTERN[1:5]
    assert s.token_ids == PATTERN[:5] and s.num_computed_tokens == 16 and s.sample
    scheduler.update(out, verified(out, {"r0": 2}, next_token=42))
    assert request.output_token_ids == [5, 6, 7, 42]
    assert request.num_computed_tokens == 19  # the last known token and two drafts
    assert request.num_tokens == 20
    # keyed: the blocks full of computed tokens only (19 -> 4 blocks; the 5th holds the
    # last token, whose KV is still to compute, and rejected slots)
    assert scheduler.kv_cache.num_cached_blocks == 4
    scheduler.check_integrity()
    out = scheduler.schedule()
    (s,) = out.scheduled
    assert s.num_computed_tokens == 19 and s.token_ids[0] == 42


def test_drafts_never_reach_past_max_tokens_and_a_stop_ends_the_tokens() -> None:
    scheduler = spec_scheduler()
    short = copying("short", max_tokens=3)
    stops = Request("stops", PATTERN * 2, SamplingParams(max_tokens=32, stop_token_ids=(7,)),
                    arrival_time=1.0)
    to_decode(scheduler, short, stops)
    out = scheduler.schedule()
    drafts = {s.request_id: s.num_draft_tokens for s in out.scheduled}
    assert drafts == {"short": 1, "stops": 4}  # short: 1 output, 1 draft + 1 token = 3
    finished = scheduler.update(out, verified(out, next_token=99))
    assert short.output_token_ids == [5, 6, 99] and short.finish_reason == "length"
    assert stops.output_token_ids == [5, 6, 7] and stops.finish_reason == "stop"
    assert {r.request_id for r in finished} == {"short", "stops"}
    scheduler.check_integrity()
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


@pytest.mark.parametrize(("params", "num_drafts"), [
    ({"num_speculative_tokens": 0}, 0),
    ({"num_speculative_tokens": 2}, 2),
    ({"num_speculative_tokens": 9}, 4),  # capped by the server's
    ({"presence_penalty": 0.5}, 0),
    ({"grammar": "start: /a+/"}, 0),
    ({"min_tokens": 3}, 0),  # one output so far: its stop tokens are still masked
])
def test_who_speculates(params: dict, num_drafts: int) -> None:
    scheduler = spec_scheduler()
    to_decode(scheduler, copying("r0", **params))
    (s,) = scheduler.schedule().scheduled
    assert s.num_draft_tokens == num_drafts


def test_a_grammar_cuts_the_drafts_before_any_slot_is_allocated_for_them() -> None:
    # block size 4: the 17-token contexts decode at position 16 (a 5th block); 4 drafts
    # reach position 20 (a 6th), 2 drafts stop at 18 (the 5th)
    scheduler = spec_scheduler(block_size=4)
    checked: list[tuple[str, list[int]]] = []

    def check(request_id: str, drafts: list[int]) -> int:
        checked.append((request_id, list(drafts)))
        return {"cut": 2, "rejected": 0}[request_id]

    assert scheduler.speculation is not None
    scheduler.speculation.check_drafts = check
    grammar = "start: /[0-9]+/"  # never read here: the check stands for it
    requests = [copying("cut", grammar=grammar), copying("rejected", grammar=grammar),
                copying("free")]
    to_decode(scheduler, *requests)
    checked.clear()
    out = scheduler.schedule()
    drafts = {s.request_id: s.draft_token_ids for s in out.scheduled}
    assert drafts == {"cut": PATTERN[1:3], "rejected": [], "free": PATTERN[1:5]}
    assert checked == [("cut", PATTERN[1:5]), ("rejected", PATTERN[1:5])]  # the free one: no
    blocks = {s.request_id: len(s.block_table) for s in out.scheduled}
    assert blocks == {"cut": 5, "rejected": 5, "free": 6}
    scheduler.update(out, verified(out))
    assert requests[0].output_token_ids == PATTERN[:4]  # both drafts and one token
    scheduler.check_integrity()


def test_drafts_go_in_priority_order_within_the_verify_budget() -> None:
    # 3 decodes + at most 6 drafts: the urgent one gets 4, the next 2, the last none
    scheduler = spec_scheduler(policy="priority", max_num_verify_tokens=9)
    to_decode(scheduler, copying("low", 5), copying("mid", 0), copying("urgent", -5))
    drafts = {s.request_id: s.num_draft_tokens for s in scheduler.schedule().scheduled}
    assert drafts == {"urgent": 4, "mid": 2, "low": 0}


@pytest.mark.parametrize(("prompt_priority", "low_drafts", "prompt_tokens"),
                         [(0, 0, 34), (10, 4, 30)])
def test_drafts_never_take_budget_from_a_more_urgent_prefill(
    prompt_priority: int, low_drafts: int, prompt_tokens: int
) -> None:
    # 40 tokens: two decodes, urgent's 4 drafts, then a 34-token prompt more urgent than
    # low takes all that is left before low's drafts; a less urgent one comes after them
    scheduler = spec_scheduler(policy="priority", max_num_batched_tokens=40)
    to_decode(scheduler, copying("low", 5), copying("urgent", -5))
    scheduler.add_request(Request("prompt", list(range(100, 134)), SamplingParams(),
                                  placement=Placement(priority=prompt_priority), arrival_time=9.0))
    out = scheduler.schedule()
    tokens = {s.request_id: len(s.token_ids) for s in out.scheduled}
    drafts = {s.request_id: s.num_draft_tokens for s in out.scheduled}
    assert drafts == {"urgent": 4, "low": low_drafts, "prompt": 0}
    assert tokens == {"urgent": 5, "low": 1 + low_drafts, "prompt": prompt_tokens}


def test_fcfs_gives_drafts_before_prefills() -> None:
    scheduler = spec_scheduler(max_num_batched_tokens=8)
    to_decode(scheduler, copying("r0"))
    scheduler.add_request(Request("prompt", list(range(100, 115)), SamplingParams(),
                                  arrival_time=9.0))
    out = scheduler.schedule()
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("r0", 5),
                                                                         ("prompt", 3)]


def test_drafts_take_free_blocks_only_and_never_preempt() -> None:
    # 11 blocks of 4: two 16-token prompts hold 4 each, and one more for their decodes
    scheduler = spec_scheduler(num_blocks=11, block_size=4)
    to_decode(scheduler, copying("r0"), Request("r1", PATTERN * 2, SamplingParams(
        max_tokens=32, ignore_eos=True), arrival_time=1.0))
    out = scheduler.schedule()
    drafts = {s.request_id: s.num_draft_tokens for s in out.scheduled}
    assert drafts == {"r0": 4, "r1": 0}  # r0 took the last free block for its drafts
    assert not out.preempted_ids
    assert scheduler.kv_cache.num_free_blocks == 0


def test_the_counters_count_proposals_and_acceptances_by_position_and_priority() -> None:
    scheduler = spec_scheduler()  # NOTE: fcfs: both decode from the same step on
    to_decode(scheduler, copying("a", 1), copying("b", 2))
    out = scheduler.schedule()
    scheduler.update(out, verified(out, {"a": 3, "b": 1}))
    stats = scheduler.stats.spec_decode
    assert stats is not None
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 8, 4)
    assert stats.accepted_per_position == (2, 1, 1, 0)
    assert stats.draft_tokens_by_priority == {1: 4, 2: 4}
    assert stats.accepted_tokens_by_priority == {1: 3, 2: 1}
    assert make_scheduler().stats.spec_decode is None


def test_a_runner_that_does_not_verify_accepts_no_draft() -> None:
    scheduler = spec_scheduler()
    request = copying("r0")
    to_decode(scheduler, request)
    out = scheduler.schedule()
    scheduler.update(out, make_runner_output(out, lambda s: 77))
    assert request.output_token_ids == [5, 77]
    assert request.num_computed_tokens == 17
    scheduler.check_integrity()


def test_an_abort_storm_mid_verification_leaks_no_block() -> None:
    rng = random.Random(0)
    scheduler = spec_scheduler(policy="priority", num_blocks=24, block_size=4,
                               max_num_batched_tokens=40)
    ids = iter(range(10_000))
    for _ in range(200):
        while len(scheduler.requests) < 10:
            i = next(ids)
            scheduler.add_request(Request(f"r{i}", PATTERN * rng.randint(1, 3),
                                          SamplingParams(max_tokens=rng.randint(2, 20),
                                                         ignore_eos=True),
                                          placement=Placement(priority=rng.randint(-2, 2)),
                                          arrival_time=float(i)))
        out = scheduler.schedule()
        drafted = [s.request_id for s in out.scheduled if s.num_draft_tokens]
        doomed = rng.sample(drafted, k=len(drafted) // 2)
        scheduler.finish_requests(doomed, RequestStatus.FINISHED_ABORTED)
        accepted = {s.request_id: rng.randint(0, s.num_draft_tokens) for s in out.scheduled}
        scheduler.update(out, verified(out, accepted, next_token=PATTERN[rng.randrange(8)]))
        scheduler.check_integrity()
    stats = scheduler.stats
    assert stats.spec_decode is not None and stats.spec_decode.num_accepted_tokens > 0
    assert stats.num_preemptions_total > 0
    scheduler.finish_requests(list(scheduler.requests), RequestStatus.FINISHED_ABORTED)
    scheduler.check_integrity()
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks
