"""The step rate of the engine core on the simulated runner: device time T and host work
H per step, plain or overlapped steps (`async_scheduling`)."""

from __future__ import annotations

import time

from engine.core import EngineCore
from engine.messages import AddRequests, NewRequest
from kvcache.config import CacheConfig
from model_runner.config import ModelConfig
from model_runner.simulated_runner import SimulatedRunner
from scheduler.config import SchedulerConfig
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler


def steps_per_s(spec, step_ms: float, host_ms: float, batch: int, steps: int,
                async_scheduling: bool) -> float:
    """Decode steps per second once `batch` requests run (the prefill step excluded)."""
    blocks = batch * (-(-(16 + steps + 2) // 16))
    runner = SimulatedRunner(spec, ModelConfig(num_kv_blocks=blocks), step_ms, host_ms)
    config = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=batch * 16,
                             async_scheduling=async_scheduling)
    core = EngineCore(Scheduler(config, CacheConfig(num_blocks=blocks, block_size=16)),
                      runner, frozenset(spec.eos_token_ids))
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    core.apply(AddRequests([NewRequest(request_id=f"r{i}", prompt_token_ids=list(range(1, 17)),
                                       sampling_params=params)
                            for i in range(batch)]))
    core.step_fn()  # the prefill
    start = time.perf_counter()
    for _ in range(steps):
        core.step_fn()
    elapsed = time.perf_counter() - start
    while core.has_work:
        core.step_fn()
    return steps / elapsed
