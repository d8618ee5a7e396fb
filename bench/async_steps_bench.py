"""Overlapped steps on the simulated runner: the step rate against device time T and
host work H.

`python -m bench.async_steps_bench [--step-ms 10] [--host-ms 0,3,6] [--batch 256]`:
`batch` requests decode on a SimulatedRunner whose steps take T ms of device time (a
sleep) after H ms of host work in each launch (a busy loop, as input preparation is),
and the engine core adds its own host work (schedule, update, the step's message).
Plain steps run at 1/(T + H + core); with `async_scheduling` step n+1's host work runs
while step n is on the device, so the rate should be within 10% of 1/T while H + core
stays under T. Both are measured in one run.
"""

from __future__ import annotations

import argparse
import time

from engine.core import EngineCore
from engine.messages import AddRequests, NewRequest
from kvcache.config import CacheConfig
from model_runner.config import ModelConfig
from model_runner.loader import load_model_spec
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--host-ms", default="0,3,6")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    spec = load_model_spec(ModelConfig())
    ideal = 1000 / args.step_ms
    print(f"T = {args.step_ms:g} ms device time per step, batch {args.batch}: steps/s "
          f"(1/T = {ideal:.1f})")
    for host_ms in map(float, args.host_ms.split(",")):
        plain = steps_per_s(spec, args.step_ms, host_ms, args.batch, args.steps, False)
        overlapped = steps_per_s(spec, args.step_ms, host_ms, args.batch, args.steps, True)
        print(f"H = {host_ms:4g} ms: plain {plain:6.1f} ({plain / ideal:.2f} of 1/T, "
              f"1/(T+H) = {1000 / (args.step_ms + host_ms):.1f})   overlapped {overlapped:6.1f} "
              f"({overlapped / ideal:.2f} of 1/T)")


if __name__ == "__main__":
    main()
