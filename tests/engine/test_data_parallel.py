"""Data parallelism on scripted in-process cores: the balancer (waiting of equal or better
priority, then KV headroom, then prefix affinity), aborts and snapshots across cores,
a dead core failing only its own requests, and metrics labelled by engine."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from engine.client import EngineClient, EngineInfo
from engine.data_parallel import DataParallelEngine, PrefixAffinity
from engine.metrics import ServerMetrics
from engine.outputs import EngineStepError
from engine.request import EngineRequest
from kvcache.config import CacheConfig
from scheduler.config import SchedulerConfig
from scheduler.placement import Placement
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from tests.conftest import BYTE_EOS, ByteTokenizer, ScriptedRunner
from tests.support.engine_helpers import step_faults
from tests.support.live_server import LiveServer
from tests.support.metrics import engine_metric
from tests.support.reliability_helpers import assert_openai_error
from tests.support.waits import wait_idle

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


def greedy(request_id: str, prompt: list[int], priority: int = 0) -> EngineRequest:
    return EngineRequest(request_id, [prompt], GREEDY, placement=Placement(priority=priority))


class SlowRunner(ScriptedRunner):
    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.step_s = step_s

    def execute(self, plan):
        time.sleep(self.step_s)
        return super().execute(plan)


def make_dp(num: int = 2, step_s: float = 0.0, max_num_seqs: int = 4) -> DataParallelEngine:
    engines, shared = [], None
    for i in range(num):
        scheduler = Scheduler(
            SchedulerConfig(policy="priority", max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=64, max_model_len=128),
            CacheConfig(num_blocks=64, block_size=4),
        )
        info = EngineInfo("fake-model", scheduler.max_request_len, 257, "priority",
                          ByteTokenizer(), frozenset({BYTE_EOS}))
        metrics = ServerMetrics("fake-model", engine=str(i), shared=shared)
        shared = shared or metrics
        engines.append(EngineClient.in_process(scheduler, SlowRunner(step_s), info, metrics))
    return DataParallelEngine(engines)


@pytest.fixture
def dp():
    made: list[DataParallelEngine] = []

    def make(**kwargs) -> DataParallelEngine:
        engine = make_dp(**kwargs)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.shutdown()


def test_prefix_affinity_finds_the_longest_known_prefix() -> None:
    affinity = PrefixAffinity()
    shared = list(range(100, 164))  # four chunks of 16
    affinity.record(shared + [1] * 20, core=1)
    affinity.record(shared[:32] + [2] * 40, core=0)
    assert affinity.lookup(shared + [3] * 5) == 1
    assert affinity.lookup(shared[:40]) == 0  # two chunks known, both last taken by 0
    assert affinity.lookup([7] * 64) is None
    assert affinity.lookup(shared[:10]) is None  # shorter than a chunk


def test_requests_go_where_fewer_of_equal_or_better_priority_wait(dp) -> None:
    engine = dp(step_s=0.02, max_num_seqs=1)
    engine.start()
    a, b = engine.engines

    async def drain(streams) -> None:
        for stream in streams:
            async for _ in stream:
                pass

    async def run() -> tuple[list[int], int]:
        spread = [engine.add_request(greedy(f"low{i}", [65 + i], 10))
                  for i in range(4)]
        cores = [engine._owner[f"low{i}"] for i in range(4)]  # pending adds count
        await drain(spread)
        # Core 0: one runs and two wait at priority 10; core 1: one runs, one waits at 0.
        held = [a.add_request(greedy(f"a{i}", [70 + i], 10)) for i in range(3)]
        held += [b.add_request(greedy(f"b{i}", [80 + i], 0)) for i in range(2)]
        await asyncio.sleep(0.1)  # both cores have reported their queues
        assert a.load(5)[0] == 0 and b.load(5)[0] == 1
        stream = engine.add_request(greedy("mid", [90], 5))
        chosen = engine._owner["mid"]
        await drain([*held, stream])
        return cores, chosen

    cores, chosen = asyncio.run(run())
    assert cores == [0, 1, 0, 1]
    # More requests wait on core 0 in all, but none it would queue behind.
    assert chosen == 0


def test_a_shared_prefix_sticks_to_one_core(dp) -> None:
    engine = dp()
    engine.start()
    prefix = [1 + (i % 200) for i in range(64)]

    async def run() -> list[int]:
        cores = []
        for i in range(8):  # one after another: the queues are equal, the prefix decides
            stream = engine.add_request(greedy(f"p{i}", prefix + [200 + i]))
            cores.append(engine._owner[f"p{i}"])
            async for _ in stream:
                pass
        return cores

    cores = asyncio.run(run())
    assert len(set(cores)) == 1, cores


def test_a_dead_core_fails_its_own_requests_and_the_other_serves(dp) -> None:
    engine = dp(step_s=0.005, max_num_seqs=1)  # one seat: the later arrivals wait, and count
    server = LiveServer(engine)
    try:
        body = {"prompt": "x", "max_tokens": 60, "ignore_eos": True}
        results: dict[int, httpx.Response] = {}

        def post(i: int) -> None:
            results[i] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)

        threads = [threading.Thread(target=post, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 10
        while len(engine._owner) < 6:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        doomed = engine.engines[1]
        on_doomed = sum(core == 1 for core in engine._owner.values())
        assert 0 < on_doomed < 6  # both cores took requests (arrivals race the stats)

        class _Fatal(BaseException):
            pass

        def die(plan) -> None:
            raise _Fatal

        step_faults(doomed).on_launch = die
        for thread in threads:
            thread.join()
        statuses = sorted(r.status_code for r in results.values())
        assert statuses == [200] * (6 - on_doomed) + [500] * on_doomed, statuses
        health = httpx.get(f"{server.url}/health").json()
        assert health["status"] == "degraded" and list(health["dead_engines"]) == ["1"]
        for _ in range(3):  # new requests go to the live core
            response = httpx.post(f"{server.url}/v1/completions",
                                  json={"prompt": "y", "max_tokens": 3}, timeout=30)
            assert response.status_code == 200
        state = wait_idle(server.url)
        assert list(state["engines"]) == ["0"]
    finally:
        server.stop()


def test_when_every_core_is_dead_requests_get_503(dp) -> None:
    engine = dp()
    server = LiveServer(engine)
    try:
        for core in engine.engines:
            core._on_death("killed in a test")
        assert_openai_error(httpx.get(f"{server.url}/health"), 503, "engine 0", "engine 1")
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"})
        assert_openai_error(response, 503)
    finally:
        server.stop()


def test_metrics_carry_the_engine_label_and_aborts_reach_the_right_core(dp) -> None:
    engine = dp(step_s=0.005)
    engine.start()

    async def run() -> None:
        streams = [engine.add_request(greedy(f"r{i}", [70 + i])) for i in range(4)]
        engine.abort("r3")
        for stream in streams:
            try:
                async for _ in stream:
                    pass
            except EngineStepError:
                raise
        state = await engine.snapshot(check_integrity=True)
        assert state["integrity"] == "ok" and set(state["engines"]) == {"0", "1"}

    asyncio.run(run())
    by_engine = [engine_metric(engine, "pagedserve_request_success_total", engine=str(i),
                               finished_reason="length") for i in (0, 1)]
    aborted = engine_metric(engine, "pagedserve_request_success_total", finished_reason="abort")
    assert sum(by_engine) == 3 and all(by_engine) and aborted == 1
    assert engine._owner == {}


class FakeStart:
    """An `EngineStart` of a scripted core that records the order of starts and waits."""

    def __init__(self, events: list[str], name: str, fails: bool) -> None:
        self.events, self.name, self.fails = events, name, fails
        self.engine: EngineClient | None = None
        events.append(f"start {name}")

    def wait(self, metrics_factory) -> EngineClient:
        self.events.append(f"wait {self.name}")
        if self.fails:
            raise ValueError(f"{self.name} failed to load")
        scheduler = Scheduler(SchedulerConfig(policy="priority", max_model_len=128),
                              CacheConfig(num_blocks=16, block_size=4))
        info = EngineInfo("fake-model", scheduler.max_request_len, 257, "priority",
                          ByteTokenizer(), frozenset({BYTE_EOS}))
        self.engine = EngineClient.in_process(scheduler, ScriptedRunner(), info,
                                        metrics_factory("fake-model"))
        return self.engine

    def cancel(self) -> None:
        self.events.append(f"cancel {self.name}")


@pytest.mark.parametrize("failing", [None, "core1", "core0"])
def test_every_core_starts_before_any_is_waited_for_and_a_failure_stops_the_rest(
    failing: str | None,
) -> None:
    from engine.data_parallel import create_data_parallel_engine
    from model_runner.config import ModelConfig

    events: list[str] = []
    starts: list[FakeStart] = []

    def start(core_name: str, num_threads: int, model_config: ModelConfig,
              **_: object) -> FakeStart:
        assert model_config.memory_share == 1 / 3  # each core's part of the host
        starts.append(FakeStart(events, core_name, fails=core_name == failing))
        return starts[-1]

    config = ModelConfig(device="cpu")
    if failing is None:
        engine = create_data_parallel_engine(3, start, model_config=config)
        assert events == ["start core0", "start core1", "start core2",
                          "wait core0", "wait core1", "wait core2"]
        engine.shutdown()
        return
    with pytest.raises(ValueError, match=f"{failing} failed"):
        create_data_parallel_engine(3, start, model_config=config)
    waited = int(failing[-1]) + 1
    assert events[:3 + waited] == ["start core0", "start core1", "start core2",
                                   *[f"wait core{i}" for i in range(waited)]]
    # the ones waited for before are shut down; the failed one and the rest are cancelled
    assert events[3 + waited:] == [f"cancel core{i}" for i in range(waited - 1, 3)]
    assert all(not s.engine.is_alive for s in starts[:waited - 1])


def test_vllm_names_carry_one_series_per_core_as_vllms(dp) -> None:
    """Under vLLM's names each core's gauges are its own series (`engine`, as vLLM labels
    them), equal to ours, and each core's KV pool is its own `vllm:cache_config_info`."""
    engine = dp()
    for i, core in enumerate(engine.engines):
        core.metrics.set_scheduler_gauges(running=1 + i, waiting=3 * i, kv_cache_usage=0.25 * i)
    for i in (0, 1):
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            value = engine_metric(engine, f"vllm:{name}", engine=str(i), model_name="fake-model")
            assert value == engine_metric(engine, f"pagedserve_{name}", engine=str(i)), name
        assert engine_metric(engine, "vllm:cache_config_info", engine=str(i), block_size="4",
                             num_gpu_blocks="64") == 1
    assert engine_metric(engine, "vllm:num_requests_waiting") == 3
    assert engine_metric(engine, "vllm:cache_config_info") == 2
