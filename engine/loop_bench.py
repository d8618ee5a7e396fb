"""`pagedserve bench --engine-loop`: the in-process engine step loop, no HTTP.

Builds the engine core as `pagedserve serve --simulate-step-ms MS` does (the default
model's tokenizer, a SimulatedRunner) and steps it in this process (schedule, launch,
update, and the per-step message the core would send) with the same requests as the
HTTP load generator, at most `concurrency` in flight, so that the HTTP figure of one run
has the in-process ceiling beside it.

    pagedserve bench --engine-loop --simulate-step-ms 10 --num-requests 256 \\
        --concurrency 256 --input-len 128 --output-len 256
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from engine.messages import AddRequests, NewRequest
from loadgen.client import BenchConfig, make_items
from model_runner.config import ModelConfig
from model_runner.loader import load_model_spec
from scheduler.config import SchedulerConfig
from scheduler.sampling_params import SamplingParams

# NOTE: the simulated pool holds no tensors, so it can be as large as the load needs.
_NUM_KV_BLOCKS = 32768
_MAX_NUM_BATCHED_TOKENS = 8192


def run_engine_loop(
    config: BenchConfig, step_ms: float, async_scheduling: bool = False
) -> dict[str, Any]:
    """Steps until every request of `config` finished (overlapped steps with
    `async_scheduling`); tokens, steps and wall time."""
    from engine.core import EngineCore
    from engine.core_setup import build_core_parts

    concurrency = config.concurrency or 8
    model_config = ModelConfig(
        num_kv_blocks=_NUM_KV_BLOCKS, max_num_seqs=concurrency,
        max_num_batched_tokens=_MAX_NUM_BATCHED_TOKENS, device="cpu", seed=config.seed,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=concurrency, max_num_batched_tokens=_MAX_NUM_BATCHED_TOKENS,
        async_scheduling=async_scheduling,
    )
    scheduler, runner, info, _ = build_core_parts(
        model_config, scheduler_config, simulate_step_ms=step_ms
    )
    core = EngineCore(scheduler, runner, frozenset(info.eos_token_ids))
    tokenizer = load_model_spec(model_config).tokenizer
    pending = deque(make_items(config))
    num_requests = len(pending)

    def admit() -> None:
        while pending and scheduler.num_running + scheduler.num_waiting < concurrency:
            item = pending.popleft()
            if not isinstance(item.prompt, list):
                item_ids = list(tokenizer.encode(item.prompt))
            else:
                item_ids = item.prompt
            params = SamplingParams(temperature=config.temperature, max_tokens=item.max_tokens,
                                    ignore_eos=config.ignore_eos)
            new = NewRequest(request_id=f"r{len(pending)}", prompt_token_ids=item_ids,
                             sampling_params=params)
            core.apply(AddRequests([new]))

    num_tokens = num_steps = 0
    start = time.perf_counter()
    cpu_start = time.process_time()
    admit()
    while core.has_work:
        num_tokens += sum(len(d.new_token_ids) for d in core.step_fn().deltas)
        num_steps += 1
        admit()
    duration = time.perf_counter() - start
    cpu_s = time.process_time() - cpu_start
    return {
        "mode": "engine-loop",
        "simulate_step_ms": step_ms,
        "num_requests": num_requests,
        "num_steps": num_steps,
        "duration_s": duration,
        "output_tokens": num_tokens,
        "output_token_throughput": num_tokens / duration,
        "steps_per_s": num_steps / duration,
        "cpu_s_per_1k_tokens": 1000 * cpu_s / max(num_tokens, 1),
    }


def format_engine_loop(summary: dict[str, Any]) -> str:
    return (
        f"engine loop ({summary['simulate_step_ms']:g} ms simulated steps): "
        f"{summary['output_tokens']} output tokens of {summary['num_requests']} requests in "
        f"{summary['duration_s']:.2f} s: {summary['output_token_throughput']:.1f} tok/s, "
        f"{summary['steps_per_s']:.1f} steps/s, "
        f"{summary['cpu_s_per_1k_tokens']:.3f} CPU s per 1k tokens"
    )
