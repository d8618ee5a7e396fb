"""prompt_logprobs: the scheduler's flag and bookkeeping (fake runner), then the runner's
values against Hugging Face's forward on a tiny random Llama."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.core import EngineCore
from engine.messages import AddRequests, NewRequest
from kvcache.config import CacheConfig
from model_runner.config import ModelConfig
from model_runner.loader import load_model
from scheduler.config import SchedulerConfig
from scheduler.output import ModelRunnerOutput, PromptLogprobs, SchedulerOutput
from scheduler.placement import Placement
from scheduler.request import Request, RequestStatus
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from tests.support.model_helpers import CONFIGS, TinyModel, make_model_folder, prompts
from tests.support.scheduler_helpers import fake_token, make_scheduler

WITH_PROMPT_LOGPROBS = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=2)


class FakeRunner:
    """One fake token per sampling row, and for each prompt logprob row the value
    -(prompt index) so that gaps and repeats show; counts how often each index is made."""

    def __init__(self) -> None:
        self.made: dict[str, list[int]] = {}

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        for s in plan.scheduled:
            lo, hi = s.prompt_logprob_rows
            if hi > lo:
                first = s.num_computed_tokens + lo + 1
                indices = list(range(first, first + hi - lo))
                self.made.setdefault(s.request_id, []).extend(indices)
                out.prompt_logprobs[s.request_id] = PromptLogprobs(
                    first, [-float(i) for i in indices], [1] * len(indices),
                    [[(s.prompt_token_ids[i], -float(i))] for i in indices],
                )
            if s.sample:
                out.sampled_token_ids[s.request_id] = fake_token(s)
        return out


def run(scheduler: Scheduler, runner, max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return
        plan = scheduler.schedule()
        scheduler.update(plan, runner.execute(plan))
        scheduler.check_integrity()
    raise AssertionError("requests left after max_steps")


def prompt(n: int, base: int = 100) -> list[int]:
    return [base + i for i in range(n)]


def assert_whole(request: Request) -> None:
    logprobs = request.prompt_logprobs
    assert logprobs is not None and logprobs.start == 1
    assert logprobs.logprobs == [-float(i) for i in range(1, request.num_prompt_tokens)]


def test_prompt_logprobs_extend_drops_repeats_and_refuses_gaps():
    joined = PromptLogprobs(1, [-1.0, -2.0], [1, 2], [[], []])
    joined.extend(PromptLogprobs(2, [-2.0, -3.0], [2, 3], [[], [(5, -0.1)]]))
    assert (joined.logprobs, joined.ranks, joined.top) == ([-1.0, -2.0, -3.0], [1, 2, 3],
                                                          [[], [], [(5, -0.1)]])
    with pytest.raises(ValueError, match="expected 4"):
        joined.extend(PromptLogprobs(5, [-5.0], [1], [[]]))


def test_chunked_prompt_bypasses_the_prefix_cache():
    scheduler = make_scheduler(max_num_batched_tokens=8, num_blocks=64)
    runner = FakeRunner()
    cached = Request("cached", prompt(30), SamplingParams(max_tokens=2, ignore_eos=True))
    scheduler.add_request(cached)
    run(scheduler, runner)
    asked = Request("asked", prompt(30), WITH_PROMPT_LOGPROBS)
    plain = Request("plain", prompt(30), SamplingParams(max_tokens=2, ignore_eos=True))
    scheduler.add_request(asked)
    scheduler.add_request(plain)
    run(scheduler, runner)
    assert plain.num_cached_tokens > 0  # the prompt was in the cache
    assert asked.num_cached_tokens == 0
    assert_whole(asked)
    assert sorted(runner.made) == ["asked"]  # nobody else pays
    assert runner.made["asked"] == list(range(1, 30))  # each index once, in order


def test_preempted_mid_prompt_keeps_what_it_made_and_makes_only_the_rest():
    scheduler = make_scheduler(policy="priority", max_num_batched_tokens=8, num_blocks=12)
    runner = FakeRunner()
    victim = Request("victim", prompt(40), WITH_PROMPT_LOGPROBS, placement=Placement(priority=1))
    scheduler.add_request(victim)
    for _ in range(2):  # 16 of 40 prompt tokens computed
        plan = scheduler.schedule()
        scheduler.update(plan, runner.execute(plan))
    assert victim.prompt_logprobs is not None and victim.prompt_logprobs.end == 17
    scheduler.add_request(Request("urgent", prompt(20, 900), SamplingParams(max_tokens=2),
                                  placement=Placement(priority=0)))
    run(scheduler, runner)
    assert victim.num_preemptions == 1
    assert_whole(victim)
    assert runner.made["victim"] == list(range(1, 40))  # none made twice


def test_preempted_after_the_prompt_recomputes_from_the_cache():
    scheduler = make_scheduler(policy="priority", max_num_batched_tokens=64, num_blocks=12)
    runner = FakeRunner()
    victim = Request("victim", prompt(20), replace(WITH_PROMPT_LOGPROBS, max_tokens=20),
                     placement=Placement(priority=1))
    scheduler.add_request(victim)
    for _ in range(3):
        plan = scheduler.schedule()
        scheduler.update(plan, runner.execute(plan))
    scheduler.add_request(Request("urgent", prompt(36, 900), SamplingParams(max_tokens=2),
                                  placement=Placement(priority=0)))
    run(scheduler, runner)
    assert victim.num_preemptions == 1
    assert_whole(victim)
    assert runner.made["victim"] == list(range(1, 20))


@pytest.mark.parametrize("caching", [True, False])
def test_choices_share_the_leaders_prompt_logprobs(caching: bool):
    scheduler = make_scheduler(max_num_batched_tokens=8, num_blocks=64,
                               enable_prefix_caching=caching)
    runner = FakeRunner()
    leader = Request("c-0", prompt(21), WITH_PROMPT_LOGPROBS)
    choices = [Request(f"c-{i}", prompt(21), WITH_PROMPT_LOGPROBS, prompt_leader_id="c-0")
               for i in (1, 2)]
    for request in [leader, *choices]:
        scheduler.add_request(request)
    run(scheduler, runner)
    for request in [leader, *choices]:
        assert_whole(request)
    assert sorted(runner.made) == ["c-0"]


def test_a_choice_whose_leader_is_gone_computes_its_own():
    scheduler = make_scheduler(max_num_batched_tokens=8, num_blocks=64)
    runner = FakeRunner()
    leader = Request("c-0", prompt(21), WITH_PROMPT_LOGPROBS)
    choice = Request("c-1", prompt(21), WITH_PROMPT_LOGPROBS, prompt_leader_id="c-0")
    scheduler.add_request(leader)
    scheduler.add_request(choice)
    plan = scheduler.schedule()
    scheduler.update(plan, runner.execute(plan))
    scheduler.finish_requests(["c-0"], RequestStatus.FINISHED_ABORTED)
    run(scheduler, runner)
    assert_whole(choice)
    assert runner.made["c-1"] == list(range(1, 21))


# --- the runner against Hugging Face -----------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> TinyModel:
    folder = tmp_path_factory.mktemp("llama-prompt-logprobs")
    hf_model = make_model_folder(folder, CONFIGS["llama3"]())
    return TinyModel(hf_model, load_model(ModelConfig(model=str(folder), num_kv_blocks=1)))


TOLERANCE = 1e-4


@torch.inference_mode()
def hf_prompt_logprobs(llama: TinyModel, ids: list[int], k: int):
    """Per prompt token i >= 1: log_softmax(logits[i - 1])[ids[i]], the bounds of its
    rank (a near tie may fall either way in another batch), the top-k."""
    logprobs = torch.log_softmax(llama.hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    targets = torch.tensor(ids[1:])[:, None]
    chosen = logprobs.gather(1, targets)
    lowest = ((logprobs > chosen + TOLERANCE).sum(-1) + 1).tolist()
    highest = ((logprobs > chosen - TOLERANCE).sum(-1) + 1).tolist()
    return chosen[:, 0], list(zip(lowest, highest, strict=True)), logprobs.topk(k, dim=-1)


def assert_ranks(ranks: list[int], bounds: list[tuple[int, int]]) -> None:
    assert len(ranks) == len(bounds)
    assert all(lo <= rank <= hi for rank, (lo, hi) in zip(ranks, bounds, strict=True)), (
        ranks, bounds)


def test_runner_matches_hf_forward_chunked_cached_and_batched(llama: TinyModel):
    """A 37-token prompt in chunks of up to 8 (the budget), its blocks already cached,
    next to an ordinary greedy request that is not slowed by it."""
    num_blocks = 64
    runner = llama.runner(block_size=4, num_kv_blocks=num_blocks)
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=8, max_model_len=256),
        CacheConfig(num_blocks=num_blocks, block_size=4),
    )
    asked_ids, plain_ids = prompts([37, 11], seed=5)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    scheduler.add_request(Request("warm", asked_ids, greedy))
    run(scheduler, runner)
    asked = Request("asked", asked_ids, replace(greedy, prompt_logprobs=3))
    plain = Request("plain", plain_ids, greedy)
    scheduler.add_request(asked)
    scheduler.add_request(plain)
    run(scheduler, runner)
    chosen, ranks, top = hf_prompt_logprobs(llama, asked_ids, 3)
    got = asked.prompt_logprobs
    assert got is not None and got.start == 1
    torch.testing.assert_close(torch.tensor(got.logprobs), chosen, rtol=0, atol=TOLERANCE)
    assert_ranks(got.ranks, ranks)
    assert [[t for t, _ in row] for row in got.top] == top.indices.tolist()
    torch.testing.assert_close(torch.tensor([[v for _, v in row] for row in got.top]),
                               top.values, rtol=0, atol=TOLERANCE)
    assert plain.prompt_logprobs is None
    assert plain.output_token_ids == llama.generate(plain_ids, 4)
    assert asked.output_token_ids == llama.generate(asked_ids, 4)


def test_zero_top_keeps_the_token_itself(llama: TinyModel):
    runner = llama.runner(block_size=4, num_kv_blocks=16)
    scheduler = Scheduler(SchedulerConfig(max_model_len=256), CacheConfig(num_blocks=16,
                                                                          block_size=4))
    ids = prompts([9], seed=6)[0]
    request = Request("r", ids, SamplingParams(temperature=0.0, max_tokens=1,
                                               prompt_logprobs=0))
    scheduler.add_request(request)
    run(scheduler, runner)
    chosen, ranks, _ = hf_prompt_logprobs(llama, ids, 1)
    assert request.prompt_logprobs is not None
    assert request.prompt_logprobs.top == [[]] * 8
    assert_ranks(request.prompt_logprobs.ranks, ranks)
    torch.testing.assert_close(torch.tensor(request.prompt_logprobs.logprobs), chosen,
                               rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["plain", "overlapped"])
def test_the_core_sends_them_once_with_the_first_token(llama: TinyModel, async_scheduling):
    """Chunked prompts on a pool tight enough to preempt, plain or overlapped steps: each
    request's first delta carries its prompt logprobs whole, as Hugging Face has them."""
    num_blocks = 30
    config = SchedulerConfig(policy="priority", max_num_seqs=8, max_num_batched_tokens=16,
                             max_model_len=256, async_scheduling=async_scheduling)
    core = EngineCore(Scheduler(config, CacheConfig(num_blocks=num_blocks, block_size=4)),
                      llama.runner(block_size=4, num_kv_blocks=num_blocks), frozenset({2}))
    ids = prompts([30, 21, 25, 17], seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=1)
    core.apply(AddRequests([NewRequest(request_id=f"r{i}", prompt_token_ids=p,
                                       sampling_params=params, arrival_time=i,
                                       placement=Placement(priority=-i))
                            for i, p in enumerate(ids)]))
    sent: dict[str, list[PromptLogprobs]] = {f"r{i}": [] for i in range(len(ids))}
    first_tokens: dict[str, bool] = {}
    for _ in range(500):
        if not core.has_work:
            break
        for delta in core.step_fn().deltas:
            assert delta.error is None, delta.error
            if delta.prompt_logprobs is not None:
                sent[delta.request_id].append(delta.prompt_logprobs)
                assert delta.new_token_ids and delta.request_id not in first_tokens
            first_tokens.setdefault(delta.request_id, bool(delta.new_token_ids))
    assert not core.has_work and core.scheduler.num_preemptions_total > 0
    for i, prompt_ids in enumerate(ids):
        [got] = sent[f"r{i}"]
        chosen, ranks, _ = hf_prompt_logprobs(llama, prompt_ids, 1)
        assert got.start == 1
        assert_ranks(got.ranks, ranks)
        torch.testing.assert_close(torch.tensor(got.logprobs), chosen, rtol=0, atol=TOLERANCE)
