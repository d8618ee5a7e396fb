"""Scheduler overhead per step: schedule() + update() with a full batch of decodes.

`python -m bench.scheduler_bench`: 256 running decode requests (every seat taken) and
1k, 5k and 20k waiting ones of mixed priorities, under fcfs, priority, priority with
aging (levels crossed every few steps), and priority with an abort storm (every step
16 waiting and 2 running requests are aborted, as many new ones arrive). The runner is
faked (one token per request, built outside the timed region); the clock is faked too
(10 ms a step), so aging moves as it would under a 100 steps/s GPU.

NOTE: it only imports the scheduler's public API, so the same file measures an older
tree for a baseline in the same run: `PYTHONPATH=/path/to/old/tree python
bench/scheduler_bench.py`.
"""

from __future__ import annotations

import argparse
import inspect
import random
import statistics
import time

from kvcache.config import CacheConfig
from scheduler.config import SchedulerConfig
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler

# An older tree's Request took its priority as an argument, not in a placement record.
WITH_PLACEMENT = "placement" in inspect.signature(Request).parameters

PROMPT_LEN = 128
BLOCK_SIZE = 16
STEP_S = 0.01  # simulated time per step
NUM_ABORTED_WAITING = 16
NUM_ABORTED_RUNNING = 2


class Clock:
    """Simulated time: STEP_S per step."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fake_runner(out: SchedulerOutput) -> ModelRunnerOutput:
    tokens = {s.request_id: 42 + s.context_len % 1000 for s in out.scheduled if s.sample}
    return ModelRunnerOutput(sampled_token_ids=tokens)


def make_request(i: int, priority: int, now: float) -> Request:
    # Distinct prompts: no prefix-cache hits to flatter the figure.
    prompt = [(i * 7919 + j) % 32000 for j in range(PROMPT_LEN)]
    params = SamplingParams(max_tokens=100_000, ignore_eos=True)
    if not WITH_PLACEMENT:
        return Request(f"req-{i}", prompt, params, priority=priority, arrival_time=now)
    from scheduler.placement import Placement

    return Request(f"req-{i}", prompt, params, placement=Placement(priority=priority),
                   arrival_time=now)


def bench(
    label: str,
    policy: str,
    aging_s: float | None,
    storm: bool,
    num_running: int,
    num_waiting: int,
    num_steps: int,
) -> None:
    max_len = PROMPT_LEN + num_steps + 64
    num_blocks = (num_running + 64) * (-(-max_len // BLOCK_SIZE))
    clock = Clock()
    scheduler = Scheduler(
        SchedulerConfig(
            policy=policy,
            max_num_seqs=num_running,
            max_num_batched_tokens=8192,
            max_model_len=max_len,
            priority_aging_s=aging_s,
        ),
        CacheConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE),
        clock=clock,
    )
    rng = random.Random(0)
    for i in range(num_running):
        scheduler.add_request(make_request(i, 0, clock.now))
    while any(r.num_computed_tokens < PROMPT_LEN for r in scheduler.requests.values()):
        out = scheduler.schedule()
        scheduler.update(out, fake_runner(out))
    # Waiting requests of worse priorities, arrived over the last 10 s: the seats are full.
    waiting_ids = []
    for i in range(num_running, num_running + num_waiting):
        worse = 1 if policy == "fcfs" else rng.randint(1, 8)
        arrival = clock.now - 10.0 * (num_running + num_waiting - i) / num_waiting
        scheduler.add_request(make_request(i, worse, arrival))
        waiting_ids.append(f"req-{i}")
    next_id = num_running + num_waiting

    schedule_s, update_s, abort_s = [], [], []
    for _ in range(num_steps):
        clock.now += STEP_S
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        runner_output = fake_runner(out)
        t2 = time.perf_counter()
        scheduler.update(out, runner_output)
        t3 = time.perf_counter()
        schedule_s.append(t1 - t0)
        update_s.append(t3 - t2)
        if not storm:
            if len(out.scheduled) != num_running:
                raise RuntimeError(f"expected {num_running} decodes, got {len(out.scheduled)}")
            continue
        # The storm: clients of waiting and running requests go away, new ones come.
        gone = [
            waiting_ids.pop(rng.randrange(len(waiting_ids))) for _ in range(NUM_ABORTED_WAITING)
        ]
        gone += [r.request_id for r in rng.sample(scheduler.running, NUM_ABORTED_RUNNING)]
        t4 = time.perf_counter()
        scheduler.finish_requests(gone, RequestStatus.FINISHED_ABORTED)
        abort_s.append(time.perf_counter() - t4)
        for _ in range(len(gone)):
            scheduler.add_request(make_request(next_id, rng.randint(1, 8), clock.now))
            waiting_ids.append(f"req-{next_id}")
            next_id += 1
    scheduler.check_integrity()

    # NOTE: medians, so that other processes sharing the CPU do not skew the figure.
    step_s = [a + b for a, b in zip(schedule_s, update_s, strict=True)]
    total_us = statistics.median(step_s) * 1e6
    storm_text = ""
    if abort_s:
        abort_us = statistics.median(abort_s) * 1e6
        storm_text = f"; abort of {NUM_ABORTED_WAITING + NUM_ABORTED_RUNNING} {abort_us:6.0f} us"
    print(
        f"{label:18s} {num_running} running + {num_waiting:5d} waiting: "
        f"schedule {statistics.median(schedule_s) * 1e6:6.0f} us + update "
        f"{statistics.median(update_s) * 1e6:6.0f} us; step {total_us:6.0f} us "
        f"(p90 {sorted(step_s)[len(step_s) * 9 // 10] * 1e6:6.0f} us){storm_text}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-running", type=int, default=256)
    parser.add_argument("--num-waiting", default="1000,5000,20000",
                        help="comma-separated waiting counts")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    cases = (
        ("fcfs", "fcfs", None, False),
        ("priority", "priority", None, False),
        ("priority+aging", "priority", 0.05, False),
        ("priority+storm", "priority", 0.05, True),
    )
    for label, policy, aging_s, storm in cases:
        for num_waiting in (int(n) for n in args.num_waiting.split(",")):
            bench(label, policy, aging_s, storm, args.num_running, num_waiting, args.steps)


if __name__ == "__main__":
    main()
