"""Overlapped steps (`async_scheduling`): step n+1 is scheduled and launched before step
n's tokens reach the host, and the outputs are exactly those of plain steps.

On the real runner (a tiny random Llama), under preemption, with greedy and seeded
sampling and aborts; on a scripted runner, EOS and stop strings end a request with no
token of the step after; on the simulated runner, the step rate follows the device time
alone.
"""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest

from engine.core import EngineCore
from engine.messages import AddRequests, FinishRequests, NewRequest
from kvcache.config import CacheConfig
from model_runner.config import ModelConfig
from model_runner.cuda_graphs import DecodeGraphRunner
from model_runner.loader import load_model, load_model_spec
from scheduler.config import SchedulerConfig
from scheduler.output import PLACEHOLDER_TOKEN_ID
from scheduler.placement import Placement
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from tests.conftest import BYTE_EOS, ScriptedRunner
from tests.support.engine_helpers import StepFaults
from tests.support.live_server import LiveServer
from tests.support.model_helpers import CONFIGS, TinyModel, make_model_folder
from tests.support.step_rate import steps_per_s

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyModel:
    folder = tmp_path_factory.mktemp("llama")
    hf_model = make_model_folder(folder, CONFIGS["smollm2"]())
    return TinyModel(hf_model, load_model(ModelConfig(model=str(folder), num_kv_blocks=1)))


def run_core(core: EngineCore, requests: list[NewRequest], abort_after: dict[str, int]):
    """Step `core` until done; the tokens and finish reason of each request, the number
    of steps, and the most steps in flight at once."""
    core.apply(AddRequests(requests))
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    finish: dict[str, str | None] = {}
    steps = 0
    while core.has_work:
        message = core.step_fn()
        steps += 1
        for delta in message.deltas:
            assert delta.error is None, delta.error
            assert delta.request_id not in finish, f"a token after {delta.request_id} ended"
            tokens[delta.request_id] += delta.new_token_ids
            if delta.finish_reason is not None:
                finish[delta.request_id] = delta.finish_reason
        for request_id, n in abort_after.items():
            if request_id not in finish and len(tokens[request_id]) >= n:
                core.apply(FinishRequests([request_id], stopped=False))
                finish[request_id] = "abort"
        assert steps < 2000
    return tokens, finish


def build(tiny: TinyModel, async_scheduling: bool, num_blocks: int,
          graphs: bool = False) -> EngineCore:
    runner = tiny.runner(block_size=4, num_kv_blocks=num_blocks)
    if graphs:  # decode-only steps on the static buffers, as on CUDA (eager here)
        runner.decode_graphs = DecodeGraphRunner(
            runner.model, runner.attn, max_num_seqs=8, max_model_len=runner.max_model_len,
            block_size=4, use_cuda_graphs=False,
        )
    config = SchedulerConfig(policy="priority", max_num_seqs=8, max_num_batched_tokens=48,
                             max_model_len=256, async_scheduling=async_scheduling)
    scheduler = Scheduler(config, CacheConfig(num_blocks=num_blocks, block_size=4))
    return EngineCore(scheduler, runner, frozenset({2}))


def mixed_requests() -> list[NewRequest]:
    requests = []
    for i in range(10):
        params = (GREEDY if i % 2 else
                  SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=True))
        params = replace(params, max_tokens=8 + 2 * i)
        prompt = [3 + (7 * i + j) % 200 for j in range(5 + 3 * i)]
        requests.append(NewRequest(request_id=f"r{i}", prompt_token_ids=prompt,
                                   sampling_params=params, arrival_time=i,
                                   placement=Placement(priority=i % 3)))
    return requests


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "decode-graph-runner"])
def test_overlapped_steps_give_the_tokens_of_plain_steps_under_preemption(tiny, graphs) -> None:
    aborts = {"r3": 4}
    plain = build(tiny, async_scheduling=False, num_blocks=40)
    want, want_finish = run_core(plain, mixed_requests(), aborts)
    overlapped = build(tiny, async_scheduling=True, num_blocks=40, graphs=graphs)
    got, got_finish = run_core(overlapped, mixed_requests(), aborts)
    assert overlapped.scheduler.num_preemptions_total > 0  # the pool is tight
    for request_id, tokens in want.items():
        if request_id in aborts:
            continue
        assert got[request_id] == tokens, request_id
    assert got_finish == want_finish
    scheduler = overlapped.scheduler
    scheduler.check_integrity()
    assert scheduler.kv_cache.pool.num_free_blocks == scheduler.cache_config.num_blocks


def test_the_next_step_is_launched_before_the_last_one_is_read(tiny) -> None:
    """Step n+1's plan holds the placeholder of step n's token and is launched before
    step n's result is read."""
    core = build(tiny, async_scheduling=True, num_blocks=64)
    events: list[str] = []
    launch, runner = core.runner.launch, core.runner

    def recording_launch(plan):
        step = launch(plan)
        if plan.is_empty:
            return step
        placeholders = sum(s.token_ids[-1] == PLACEHOLDER_TOKEN_ID for s in plan.scheduled)
        events.append(f"launch:{placeholders}")
        result = step.result

        def recording_result():
            events.append("result")
            return result()

        step.result = recording_result
        return step

    runner.launch = recording_launch
    run_core(core, [NewRequest(request_id="a", prompt_token_ids=[5, 6, 7],
                               sampling_params=replace(GREEDY, max_tokens=4))], {})
    # prefill; decode of the pending token launched before the prefill's result; ...
    assert events[:3] == ["launch:0", "launch:1", "result"], events
    # max_tokens=4: the step that samples the 4th token is the last launched for it
    assert events.count("result") == events.count("launch:0") + events.count("launch:1") == 4


def test_eos_and_stop_strings_end_a_stream_with_no_token_of_the_next_step(
    make_fake_engine,
) -> None:
    """The scripted runner says "Hello, wörld! Bye." then EOS: the overlapped engine
    streams exactly the plain engine's text, for EOS and for a stop string."""
    texts = {}
    for async_scheduling in (False, True):
        engine = make_fake_engine(async_scheduling=async_scheduling, start=False)
        server = LiveServer(engine)
        try:
            for stop in (None, ["! B"]):
                body = {"prompt": "x", "max_tokens": 64, "stream": False}
                if stop:
                    body["stop"] = stop
                response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
                assert response.status_code == 200, response.text
                choice = response.json()["choices"][0]
                texts[(async_scheduling, bool(stop))] = (choice["text"], choice["finish_reason"])
        finally:
            server.stop()
    assert texts[(True, False)] == texts[(False, False)] == ("Hello, wörld! Bye.", "stop")
    assert texts[(True, True)] == texts[(False, True)] == ("Hello, wörld", "stop")


def test_a_failing_overlapped_step_fails_its_requests_and_those_in_flight() -> None:
    """A step that raises with the last one in flight fails the requests of both (500s),
    frees their blocks and reads no token of theirs; the core goes on."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                             async_scheduling=True)
    scheduler = Scheduler(config, CacheConfig(num_blocks=32, block_size=4))
    faults = StepFaults(ScriptedRunner())
    core = EngineCore(scheduler, faults, frozenset({BYTE_EOS}))
    core.apply(AddRequests([  # b's one token is sampled by the prefill alone
        NewRequest(request_id="a", prompt_token_ids=[1, 2, 3], sampling_params=GREEDY),
        NewRequest(request_id="b", prompt_token_ids=[1, 2, 3],
                   sampling_params=replace(GREEDY, max_tokens=1))]))
    assert core.step_fn().deltas == []  # the prefill, in flight
    plans = []

    def fail(plan) -> None:
        plans.append(plan)
        raise RuntimeError("injected")

    faults.on_launch = fail
    failed = core.step_fn().deltas
    assert [s.request_id for s in plans[0].scheduled] == ["a"]
    assert [(d.request_id, d.error_status, d.new_token_ids) for d in failed] == [
        ("a", 500, []), ("b", 500, [])]
    assert all("error id" in (d.error or "") for d in failed)
    assert not core.has_work and scheduler.kv_cache.usage == 0
    scheduler.check_integrity()
    faults.on_launch = None
    tokens, finish = run_core(core, [NewRequest(request_id="c", prompt_token_ids=[1, 2],
                                                sampling_params=GREEDY)], {})
    assert len(tokens["c"]) == GREEDY.max_tokens and finish == {"c": "length"}


@pytest.mark.timing
def test_the_step_rate_follows_the_device_time_alone() -> None:
    """Simulated device time T = 20 ms and host work H = 10 ms per step: plain steps take
    T + H, overlapped ones T (8 requests)."""
    spec = load_model_spec(ModelConfig())
    plain, overlapped = (steps_per_s(spec, 20, 10, batch=8, steps=28, async_scheduling=mode)
                         for mode in (False, True))
    assert plain < 1 / 0.028, plain
    assert overlapped > 1 / 0.025, (plain, overlapped)
