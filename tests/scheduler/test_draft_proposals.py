"""Draft-model speculation in the scheduler, with hand-made runner outputs: a decode granted
room asks the runner for that many proposals (their lookahead slots allocated first, from
free blocks only), the next step verifies them (truncated to its room) while they still
follow the request's tokens, and the config's keys (vLLM's "model")."""

from __future__ import annotations

import pytest

from scheduler.config import SpeculativeConfig
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from tests.support.scheduler_helpers import make_scheduler

DRAFT = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=3)


def draft_scheduler(**kw) -> Scheduler:
    return make_scheduler(speculative=DRAFT, **kw)


def request(request_id: str, arrival: float = 0.0, max_tokens: int = 32) -> Request:
    return Request(request_id, list(range(10, 26)),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=arrival)


def answer(out: SchedulerOutput, proposals: dict[str, list[int]], token_id: int = 7,
           num_accepted: int | None = None) -> ModelRunnerOutput:
    """Every drafted request accepts `num_accepted` drafts (all by default) then gets
    `token_id`, as the others that sample; `proposals` are the draft model's."""
    output = ModelRunnerOutput(draft_token_ids=proposals)
    for s in out.scheduled:
        if s.num_draft_tokens:
            accepted = s.draft_token_ids[:num_accepted]
            output.verified_token_ids[s.request_id] = [*accepted, token_id]
        elif s.sample:
            output.sampled_token_ids[s.request_id] = token_id
    return output


def to_decode(scheduler: Scheduler, *requests: Request) -> None:
    for r in requests:
        scheduler.add_request(r)
    out = scheduler.schedule()
    assert all(s.sample and not s.num_lookahead_tokens for s in out.scheduled)
    scheduler.update(out, answer(out, {}))


def test_a_decode_asks_for_proposals_and_the_next_step_verifies_them() -> None:
    scheduler = draft_scheduler(block_size=4)
    r = request("r")
    to_decode(scheduler, r)  # 16 prompt tokens + 1: no proposal yet
    out = scheduler.schedule()
    (s,) = out.scheduled
    assert (s.token_ids, s.num_draft_tokens, s.num_lookahead_tokens) == ([7], 0, 3)
    # its token at 16, then the draft decodes' inputs: the newest token at 17 and two
    # proposals (18, 19): 20 slots, 5 blocks
    assert len(s.block_table) == 5
    scheduler.update(out, answer(out, {"r": [31, 32, 33]}, token_id=30))
    out = scheduler.schedule()
    (s,) = out.scheduled
    assert s.token_ids == [30, 31, 32, 33] and s.num_draft_tokens == 3
    assert s.num_lookahead_tokens == 3
    assert len(s.block_table) == 6  # positions 17..20, then the lookahead 21..23
    scheduler.update(out, answer(out, {"r": [41, 42, 43]}, token_id=40, num_accepted=1))
    assert r.output_token_ids == [7, 30, 31, 40] and r.num_computed_tokens == 19
    (s,) = scheduler.schedule().scheduled
    assert s.token_ids == [40, 41, 42, 43] and s.num_computed_tokens == 19
    scheduler.check_integrity()


def test_a_proposal_that_no_longer_follows_the_tokens_is_not_verified() -> None:
    scheduler = draft_scheduler()
    r = request("r")
    to_decode(scheduler, r)
    out = scheduler.schedule()
    scheduler.update(out, answer(out, {"r": [31, 32, 33]}))
    r.proposal_at -= 1  # made for other tokens (e.g. before a preemption's recompute)
    (s,) = scheduler.schedule().scheduled
    assert s.num_draft_tokens == 0 and s.num_lookahead_tokens == 3


def test_proposals_stop_at_max_tokens_and_at_the_verify_budget() -> None:
    scheduler = draft_scheduler(max_num_batched_tokens=64)
    short = request("short", max_tokens=3)
    to_decode(scheduler, short)
    (s,) = scheduler.schedule().scheduled
    assert s.num_lookahead_tokens == 1  # 1 output: 1 draft + 1 token = 3
    loaded = make_scheduler(speculative=SpeculativeConfig(
        method="draft_model", model="draft", num_speculative_tokens=3, max_num_verify_tokens=4))
    to_decode(loaded, *(request(f"r{i}", arrival=i) for i in range(3)))
    out = loaded.schedule()
    # 3 decodes + 1 draft: none has drafts yet, each asks for what the room gives it
    assert [s.num_lookahead_tokens for s in out.scheduled] == [1, 1, 1]
    loaded.update(out, answer(out, {f"r{i}": [5] for i in range(3)}))
    out = loaded.schedule()
    # the first takes the room with its draft: the others neither verify nor ask
    assert [(s.num_draft_tokens, s.num_lookahead_tokens) for s in out.scheduled] == [
        (1, 1), (0, 0), (0, 0)]


def test_the_last_draft_decode_stays_within_the_length_cap() -> None:
    scheduler = draft_scheduler(max_model_len=22)
    to_decode(scheduler, request("r"))
    out = scheduler.schedule()
    scheduler.update(out, answer(out, {"r": [1, 2, 3]}))
    (s,) = scheduler.schedule().scheduled
    # 18 tokens, the newest at 17: drafts at 18..20, then one draft decode at 21, the last
    # position of 22
    assert (s.num_draft_tokens, s.num_lookahead_tokens) == (3, 1)


def test_lookahead_slots_come_from_free_blocks_only() -> None:
    # 11 blocks of 4: two 16-token prompts take 4 each, their decodes (position 16) one
    # more each, whose slots 17..19 hold the lookahead: one block left free
    scheduler = draft_scheduler(num_blocks=11, block_size=4)
    to_decode(scheduler, request("a"), request("b", arrival=1.0))
    out = scheduler.schedule()
    assert {s.request_id: s.num_lookahead_tokens for s in out.scheduled} == {"a": 3, "b": 3}
    assert scheduler.kv_cache.num_free_blocks == 1
    scheduler.update(out, answer(out, {"a": [1, 2, 3], "b": [1, 2, 3]}))
    out = scheduler.schedule()
    assert not out.preempted_ids and scheduler.kv_cache.num_free_blocks == 0
    by_id = {s.request_id: (s.num_draft_tokens, s.num_lookahead_tokens) for s in out.scheduled}
    # a takes the last block for its drafts (18..20) and lookahead (21..23); b's drafts do
    # not fit, and its 5 blocks hold 2 lookahead slots after its newest token (17)
    assert by_id == {"a": (3, 3), "b": (0, 2)}


def test_a_model_key_means_a_draft_model() -> None:
    config = SpeculativeConfig.from_json('{"model": "/m", "num_speculative_tokens": 2}')
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model",
                                                                             "/m", 2)
    assert SpeculativeConfig.from_json("{}", draft_model="/m") == SpeculativeConfig(
        method="draft_model", model="/m")


@pytest.mark.parametrize(("text", "draft_model", "needle"), [
    ('{"method": "draft_model"}', None, '"model"'),
    ('{"method": "ngram", "model": "/m"}', None, '"model"'),
    ('{"model": 3}', None, "model must be str"),
    ('{"method": "ngram"}', "/m", "--speculative-model"),
    ('{"model": "/m"}', "/n", "--speculative-model"),
])
def test_a_bad_draft_model_config_says_why(text: str, draft_model: str | None,
                                           needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SpeculativeConfig.from_json(text, draft_model)
