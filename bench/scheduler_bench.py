"""Scheduler overhead per step: schedule() + update() with a full batch of decodes.

`python -m bench.scheduler_bench`: 256 running decode requests (every seat taken) and 1024
waiting ones, under fcfs, priority, and priority with aging. The runner is faked (one
token per request, built outside the timed region).
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvcache.config import CacheConfig
from scheduler.config import SchedulerConfig
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler

PROMPT_LEN = 128
BLOCK_SIZE = 16


def fake_runner(out: SchedulerOutput) -> ModelRunnerOutput:
    tokens = {s.request_id: 42 + s.context_len % 1000 for s in out.scheduled if s.sample}
    return ModelRunnerOutput(sampled_token_ids=tokens)


def make_request(i: int, priority: int) -> Request:
    # Distinct prompts: no prefix-cache hits to flatter the figure.
    return Request(
        f"req-{i}",
        [(i * 7919 + j) % 32000 for j in range(PROMPT_LEN)],
        SamplingParams(max_tokens=100_000, ignore_eos=True),
        priority=priority,
    )


def bench(
    policy: str, aging_s: float | None, num_running: int, num_waiting: int, num_steps: int
) -> None:
    max_len = PROMPT_LEN + num_steps + 64
    num_blocks = num_running * (-(-max_len // BLOCK_SIZE)) + 64
    scheduler = Scheduler(
        SchedulerConfig(
            policy=policy,
            max_num_seqs=num_running,
            max_num_batched_tokens=8192,
            max_model_len=max_len,
            priority_aging_s=aging_s,
        ),
        CacheConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE),
    )
    for i in range(num_running):
        scheduler.add_request(make_request(i, priority=0))
    while any(r.num_computed_tokens < PROMPT_LEN for r in scheduler.requests.values()):
        out = scheduler.schedule()
        scheduler.update(out, fake_runner(out))
    # Waiting requests of worse priority: the seats are full, nobody is preempted.
    for i in range(num_running, num_running + num_waiting):
        scheduler.add_request(make_request(i, priority=1))

    schedule_s, update_s = [], []
    for _ in range(num_steps):
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        runner_output = fake_runner(out)
        t2 = time.perf_counter()
        scheduler.update(out, runner_output)
        t3 = time.perf_counter()
        schedule_s.append(t1 - t0)
        update_s.append(t3 - t2)
        if len(out.scheduled) != num_running:
            raise RuntimeError(f"expected {num_running} decodes, got {len(out.scheduled)}")
    scheduler.check_integrity()

    # NOTE: medians, so that other processes sharing the CPU do not skew the figure.
    schedule_us = statistics.median(schedule_s) * 1e6
    update_us = statistics.median(update_s) * 1e6
    step_s = [a + b for a, b in zip(schedule_s, update_s, strict=True)]
    total_us = statistics.median(step_s) * 1e6
    mean_us = statistics.fmean(step_s) * 1e6
    label = policy + (f" (aging {aging_s:g}s)" if aging_s else "")
    print(
        f"{label:22s} {num_running} running + {num_waiting} waiting: "
        f"schedule {schedule_us:6.0f} us + update {update_us:6.0f} us; "
        f"step {total_us:6.0f} us, {total_us / num_running:5.2f} us/request (medians; "
        f"mean step {mean_us:.0f} us)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-running", type=int, default=256)
    parser.add_argument("--num-waiting", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    for policy, aging_s in (("fcfs", None), ("priority", None), ("priority", 60.0)):
        bench(policy, aging_s, args.num_running, args.num_waiting, args.steps)


if __name__ == "__main__":
    main()
