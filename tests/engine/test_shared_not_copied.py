"""Shared, not copied: what a request repeats for each of its choices exists once.

allowed_token_ids and logit_bias are deduplicated once, travel to the core once per HTTP
request and become one mask row on the runner's device, built once per request (not per
step, not per choice), with the same tokens as the per-row masking they replace. Prompt
logprobs are sent once per prompt by the core, shared by the prompt's choices in the API
process, written as JSON once per prompt and off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import replace

import httpx
import orjson
import pytest
import torch

from engine.core import EngineCore
from engine.messages import AddRequests, NewRequest, command_decoder, command_encoder
from engine.request import EngineRequest
from kvcache.config import CacheConfig
from model_runner.sampler import Sampler
from scheduler.config import SchedulerConfig
from scheduler.output import (
    ModelRunnerOutput,
    PromptLogprobs,
    ScheduledRequest,
    SchedulerOutput,
)
from scheduler.sampling_params import SamplingParams, unique_token_lists
from scheduler.scheduler import Scheduler
from server.app import build_app
from server.config import ServerConfig
from server.rendering import PromptLogprobsJSON
from server.requests import CompletionRequest
from server.serving import Serving
from tests.conftest import BYTE_EOS, ScriptedRunner, SyncRunner

VOCAB = 300


def reference_masks(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """The per-row masking the token masks replace (rebuilt for every row of every step)."""
    for i, p in enumerate(params):
        if p.allowed_token_ids is not None:
            keep = torch.tensor(p.allowed_token_ids)
            kept = logits[i, keep]
            logits[i].fill_(float("-inf"))
            logits[i, keep] = kept
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias])
            bias = torch.tensor([b for _, b in p.logit_bias])
            logits[i].index_add_(0, ids, bias.to(logits.dtype))


def rows(params: list[SamplingParams], step: int = 0) -> list[ScheduledRequest]:
    return [ScheduledRequest(f"r{i}", [1], 2 + step, [0], True, p, [1, 2], [3] * step)
            for i, p in enumerate(params)]


def mixed_params(temperature: float, seed: int | None) -> list[SamplingParams]:
    g = torch.Generator().manual_seed(7)
    allowed = tuple(torch.randint(0, VOCAB, (400,), generator=g).tolist())  # repeats
    _, bias = unique_token_lists(None, zip(  # NOTE: one bias per token, as the API sends
        torch.randint(0, VOCAB, (40,), generator=g).tolist(),
        (torch.rand(40, generator=g) * 200 - 100).tolist(), strict=True))
    base = SamplingParams(temperature=temperature, seed=seed, logprobs=3)
    return [
        SamplingParams(temperature=temperature, seed=seed, logprobs=3, allowed_token_ids=allowed),
        SamplingParams(temperature=temperature, seed=seed, logprobs=3, logit_bias=bias),
        base,
        SamplingParams(temperature=temperature, seed=seed, logprobs=3, allowed_token_ids=(5, 9),
                       logit_bias=((9, -3.0), (5, 2.5), (200, 100.0))),
    ]


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.8, 11)], ids=["greedy", "seeded"])
@pytest.mark.parametrize("masked_rows", ["all", "some"])
def test_token_masks_sample_what_the_per_row_masks_sampled(temperature, seed, masked_rows):
    params = mixed_params(temperature, seed)
    if masked_rows == "all":
        params = [p for p in params if p.has_token_mask]
    sampler = Sampler(torch.device("cpu"), frozenset({0}))
    expected_sampler = Sampler(torch.device("cpu"), frozenset({0}))
    expected_sampler._apply_token_masks = lambda x, r: reference_masks(  # type: ignore
        x, [s.sampling_params for s in r])
    for step in range(3):
        logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(step))
        generators = [None if seed is None else torch.Generator().manual_seed(seed + i + step)
                      for i in range(len(params))]
        expected_generators = [None if g is None else torch.Generator().set_state(g.get_state())
                               for g in generators]
        masked, expected = logits.clone(), logits.clone()
        sampler._apply_token_masks(masked, rows(params, step))
        reference_masks(expected, params)
        assert torch.equal(masked, expected)
        out = sampler(logits.clone(), rows(params, step), generators)
        want = expected_sampler(logits.clone(), rows(params, step), expected_generators)
        assert out.token_ids == want.token_ids
        assert out.logprobs == want.logprobs
    assert sampler.token_masks.num_builds == sum(p.has_token_mask for p in params)


def test_a_mask_is_built_once_per_request_and_released_with_its_last_choice():
    allowed, bias = unique_token_lists([7, 3, 7, 250, 3], [(4, 1.0)])
    command = AddRequests([NewRequest(request_id="r-0", prompt_token_ids=[1],
                                      sampling_params=SamplingParams(allowed_token_ids=allowed,
                                                                     logit_bias=bias))] + [
        NewRequest(request_id=f"r-{i}", prompt_token_ids=[1],
                   sampling_params=SamplingParams(seed=i), shares_token_lists=True)
        for i in (1, 2, 3)])
    params = command_decoder.decode(command_encoder.encode(command)).sampling_params()
    sampler = Sampler(torch.device("cpu"), frozenset({0}))
    choices = [ScheduledRequest(f"r-{i}", [1], 1, [0], True, p, [1], [])
               for i, p in enumerate(params)]
    for _ in range(5):
        out = sampler(torch.zeros(4, VOCAB), choices, [None] * 4)
        assert set(out.token_ids) <= {3, 7, 250}
    other = ScheduledRequest("s", [1], 1, [0], True, SamplingParams(
        allowed_token_ids=allowed, logit_bias=bias), [1], [])  # equal lists, not the same
    sampler(torch.zeros(1, VOCAB), [other], [None])
    assert sampler.token_masks.num_builds == 2
    sampler.forget(["r-0", "r-1", "r-2", "s"])
    sampler(torch.zeros(1, VOCAB), choices[3:], [None])  # r-3 still uses it
    sampler.forget(["r-3"])
    assert sampler.token_masks.num_rows == 2  # released, kept for a late choice
    late = ScheduledRequest("r-4", [1], 1, [0], True, replace(params[0], seed=4), [1], [])
    sampler(torch.zeros(1, VOCAB), [late], [None])
    sampler.forget(["r-4"])
    assert sampler.token_masks.num_builds == 2
    for i in range(sampler.token_masks.max_released):  # later requests push it out
        sampler(torch.zeros(1, VOCAB), [ScheduledRequest(
            f"t{i}", [1], 1, [0], True, SamplingParams(allowed_token_ids=(i,)), [1], [])], [None])
        sampler.forget([f"t{i}"])
    assert sampler.token_masks.num_rows == sampler.token_masks.max_released
    assert sampler.token_masks.num_builds == 2 + sampler.token_masks.max_released


def test_the_token_lists_are_deduplicated_once_and_travel_once(make_fake_engine):
    request = CompletionRequest.model_validate({
        "prompt": [[1, 2], [3, 4]], "n": 3, "seed": 5,
        "allowed_token_ids": [9, 4, 9, 4, 100, 9], "logit_bias": {"7": 1.0, "07": -2.0},
    })
    params = request.to_sampling_params(4, None)
    assert params.allowed_token_ids == (4, 9, 100)
    assert params.logit_bias == ((7, -2.0),)  # the last given wins
    engine = make_fake_engine()
    commands: list[AddRequests] = []
    send = engine._client.send
    engine._client.send = lambda command: (commands.append(command), send(command))

    async def run() -> None:
        async for _ in engine.add_request(EngineRequest("cmpl", [[1, 2], [3, 4]], params, n=3)):
            pass

    asyncio.run(run())
    command = commands[0]
    sent = [new.sampling_params for new in command.requests]
    assert sent[0].allowed_token_ids == (4, 9, 100) and sent[0].logit_bias == ((7, -2.0),)
    assert all(p.allowed_token_ids is None and not p.logit_bias for p in sent[1:])
    resolved = command_decoder.decode(command_encoder.encode(command)).sampling_params()
    assert all(p.allowed_token_ids is resolved[0].allowed_token_ids for p in resolved)
    assert all(p.logit_bias is resolved[0].logit_bias for p in resolved)
    assert [p.seed for p in resolved] == [5, 6, 7, 5, 6, 7]


class MaskedArgmaxRunner(SyncRunner):
    """Samples with the real Sampler from fixed logits (token t scores t % 97), so that the
    allowed ids and the bias decide; counts the sampler's mask builds."""

    def __init__(self) -> None:
        self.sampler = Sampler(torch.device("cpu"), frozenset({BYTE_EOS}))

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        self.sampler.forget(plan.finished_ids)
        out = ModelRunnerOutput()
        sampling = [s for s in plan.scheduled if s.sample]
        if sampling:
            logits = (torch.arange(VOCAB) % 97).float().repeat(len(sampling), 1)
            result = self.sampler(logits, sampling, [None] * len(sampling))
            out.sampled_token_ids = {s.request_id: t for s, t in
                                     zip(sampling, result.token_ids, strict=True)}
        return out


def test_the_core_builds_one_mask_for_all_choices_over_all_steps(make_fake_engine):
    runner = MaskedArgmaxRunner()
    engine = make_fake_engine(runner=runner, max_num_seqs=4)
    allowed, bias = unique_token_lists([10, 20, 30, 10] * 1000, [(10, 50.0)])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                            allowed_token_ids=allowed, logit_bias=bias)

    async def run() -> list[list[int]]:
        stream = engine.add_request(EngineRequest("cmpl", [[1, 2, 3], [4, 5]], params, n=3))
        tokens: dict[int, list[int]] = {}
        async for output in stream:
            tokens.setdefault(output.index, []).extend(output.token_ids)
        return [tokens[i] for i in sorted(tokens)]

    assert asyncio.run(run()) == [[10] * 6] * 6  # 10 + 50 beats 30 % 97 = 30
    assert runner.sampler.token_masks.num_builds == 1  # 6 choices, 6 steps, 4 seats


# --- prompt logprobs -----------------------------------------------------------------------

WITH_PROMPT_LOGPROBS = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=2)


def choices_of(prompts: list[list[int]], n: int, params: SamplingParams) -> AddRequests:
    """What EngineClient.add_request sends for `n` choices per prompt
    (EngineRequest.new_requests)."""
    return AddRequests([
        NewRequest(request_id=f"q-{p * n + i}", prompt_token_ids=prompt, sampling_params=params,
                   prompt_leader_id=f"q-{p * n}" if i else None)
        for p, prompt in enumerate(prompts) for i in range(n)])


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["plain", "overlapped"])
def test_the_core_sends_prompt_logprobs_once_per_prompt(async_scheduling):
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=8, max_model_len=256,
                        async_scheduling=async_scheduling),
        CacheConfig(num_blocks=64, block_size=4),
    )
    core = EngineCore(scheduler, ScriptedRunner(), frozenset({BYTE_EOS}))
    prompts = [list(range(1, 22)), list(range(30, 43))]
    core.apply(choices_of(prompts, 4, WITH_PROMPT_LOGPROBS))
    carried: list[str] = []
    shared: list[str] = []
    for _ in range(300):
        if not core.has_work:
            break
        for delta in core.step_fn().deltas:
            assert delta.error is None
            if delta.prompt_logprobs is not None:
                carried.append(delta.request_id)
                assert len(delta.prompt_logprobs.logprobs) == len(prompts[
                    int(delta.request_id[2:]) // 4]) - 1
            if delta.shares_prompt_logprobs:
                shared.append(delta.request_id)
    assert not core.has_work
    assert sorted(carried) == ["q-0", "q-4"]
    assert sorted(shared) == [f"q-{i}" for i in (1, 2, 3, 5, 6, 7)]


def test_a_prompts_choices_share_one_prompt_logprobs_object(make_fake_engine):
    engine = make_fake_engine(max_num_seqs=2)

    async def run() -> dict[int, PromptLogprobs]:
        stream = engine.add_request(
            EngineRequest("cmpl", [[1] * 9, [2] * 6], WITH_PROMPT_LOGPROBS, n=3))
        got: dict[int, PromptLogprobs] = {}
        async for output in stream:
            if output.prompt_logprobs is not None:
                assert output.index not in got
                got[output.index] = output.prompt_logprobs
        return got

    got = asyncio.run(run())
    assert sorted(got) == list(range(6))
    assert got[0] is got[1] is got[2] and got[3] is got[4] is got[5]
    assert len(got[0].logprobs) == 8 and len(got[3].logprobs) == 5


def test_prompt_logprobs_json_is_written_once_per_prompt():
    decoded: list[int] = []

    def token_text(token_id: int) -> str:
        decoded.append(token_id)
        return chr(token_id)

    write = PromptLogprobsJSON(token_text, [[65, 66, 67], [68, 69]], n=2, num_top=1)
    first = PromptLogprobs(1, [-0.5, -0.25], [2, 1], [[(90, -0.1)], [(67, -0.25)]])
    second = PromptLogprobs(1, [-1.0], [1], [[(69, -1.0)]])
    fragments = [write(0, first), write(1, first), write(2, second), write(3, second)]
    assert fragments[0] is fragments[1] and fragments[2] is fragments[3]
    assert write(0, None) is None
    assert sorted(decoded) == [66, 67, 69, 90]  # each token decoded once
    assert json.loads(orjson.dumps(fragments[0])) == [
        None,
        {"66": {"logprob": -0.5, "rank": 2, "decoded_token": "B"},
         "90": {"logprob": -0.1, "rank": 1, "decoded_token": "Z"}},
        {"67": {"logprob": -0.25, "rank": 1, "decoded_token": "C"}},
    ]


def on_no_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return True
    return False


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_prompt_logprobs_are_written_off_the_loop_while_it_serves_health(
    make_fake_engine, monkeypatch, route, stream
):
    """Writing the prompt logprobs' JSON (here: decoding their tokens) waits until /health
    has been answered: were it on the event loop, /health could never be."""
    app = build_app(make_fake_engine(script="Hi."), ServerConfig())
    health_answered = threading.Event()
    threads_ok: list[bool] = []
    token_text = Serving.token_text

    def slow_token_text(self: Serving, token_id: int) -> str:
        threads_ok.append(on_no_event_loop())
        assert health_answered.wait(timeout=30), "the event loop was blocked"
        return token_text(self, token_id)

    monkeypatch.setattr(Serving, "token_text", slow_token_text)
    body: dict = {"max_tokens": 2, "n": 2, "prompt_logprobs": 1, "stream": stream}
    if route == "chat":
        path, body = "/v1/chat/completions", {**body, "messages": [{"role": "user",
                                                                    "content": "hey"}]}
    else:
        path, body = "/v1/completions", {**body, "prompt": "hey"}

    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            generation = asyncio.ensure_future(client.post(path, json=body))
            while not threads_ok:  # the JSON is being written
                await asyncio.sleep(0.001)
            health = await client.get("/health")
            assert health.status_code == 200
            health_answered.set()
            return await generation

    response = asyncio.run(run())
    assert response.status_code == 200, response.text
    assert threads_ok and all(threads_ok)
    if stream:
        events = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: {")]
        found = [c["prompt_logprobs"] for e in events for c in e["choices"]
                 if "prompt_logprobs" in c]
    else:
        found = [c["prompt_logprobs"] for c in response.json()["choices"]]
    assert len(found) == 2 and found[0] == found[1] and found[0][0] is None
