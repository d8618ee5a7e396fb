"""Priority under a saturating load, simulated: the scheduler alone on a step-cost model.

`python -m bench.priority_sim`: the WPS load (48 requests in flight, 128 in / 96 out, 15%
of arrivals at priority -10, a new request as soon as one finishes) and the WL case (a
2,000-token priority -10 prompt among 16 low-priority streams), on the CPU defaults
(512-token budget, 128 seats, plenty of KV). Each step takes the time the cost model
gives it (fitted to the default model on this machine's two cores), on a simulated
clock: no model, no noise, and the same answer on a loaded machine.

Reported: the -10 TTFT p50 against its idle TTFT (a lone 128-token prefill) and the
loaded decode step, and the low ITL p50/p99 (the WL stall).

NOTE: it only imports the scheduler's public API, so the same file measures an older
tree for a same-run baseline: `PYTHONPATH=/path/to/old/tree python bench/priority_sim.py`.
"""

from __future__ import annotations

import argparse
import random
import statistics

from kvcache.config import CacheConfig
from scheduler.config import SchedulerConfig
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler

BUDGET = 512
# Step cost of SmolLM2-135M float32 on 2 cores (measured: 48 decodes 110 ms, with 128
# prefill tokens 215 ms, with 464 491 ms): fixed + per decode + per prefill token.
STEP_FIXED_S, PER_DECODE_S, PER_PREFILL_TOKEN_S = 0.020, 0.0019, 0.00085


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(clock: Clock, threshold: int) -> Scheduler:
    fields = dict(policy="priority", max_num_seqs=128, max_num_batched_tokens=BUDGET,
                  max_model_len=8192)
    try:
        config = SchedulerConfig(long_prefill_token_threshold=threshold, **fields)
    except TypeError:  # an older tree without the flag
        config = SchedulerConfig(**fields)
    return Scheduler(config, CacheConfig(num_blocks=8192, block_size=16), clock=clock)


class Sim:
    """Steps the scheduler on the cost model; records TTFT and ITL per request."""

    def __init__(self, threshold: int) -> None:
        self.clock = Clock()
        self.scheduler = make_scheduler(self.clock, threshold)
        self.arrival: dict[str, float] = {}
        self.last_token: dict[str, float] = {}
        self.ttft: dict[str, float] = {}
        self.itl: dict[str, list[float]] = {}
        self.priority: dict[str, int] = {}
        self.step_s: list[float] = []
        self.next_id = 0

    def add(self, prompt_len: int, max_tokens: int, priority: int) -> str:
        request_id = f"r{self.next_id}"
        self.next_id += 1
        prompt = [1000 + (self.next_id * 7919 + j) % 30000 for j in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.scheduler.add_request(
            Request(request_id, prompt, params, priority=priority, arrival_time=self.clock.now)
        )
        self.arrival[request_id] = self.clock.now
        self.priority[request_id] = priority
        self.itl[request_id] = []
        return request_id

    def step(self) -> list[Request]:
        out: SchedulerOutput = self.scheduler.schedule()
        decodes = sum(1 for s in out.scheduled if s.num_new_tokens == 1)
        prefill = sum(s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1)
        cost = STEP_FIXED_S + PER_DECODE_S * decodes + PER_PREFILL_TOKEN_S * prefill
        self.clock.now += cost
        self.step_s.append(cost)
        tokens = {s.request_id: 42 for s in out.scheduled if s.sample}
        updated = self.scheduler.update(out, ModelRunnerOutput(sampled_token_ids=tokens))
        for request in updated:
            rid = request.request_id
            if rid not in self.ttft:
                self.ttft[rid] = self.clock.now - self.arrival[rid]
            else:
                self.itl[rid].append(self.clock.now - self.last_token[rid])
            self.last_token[rid] = self.clock.now
        return [r for r in updated if r.is_finished]


def p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def idle_ttft(threshold: int) -> float:
    sim = Sim(threshold)
    sim.add(128, 1, -10)
    while sim.scheduler.has_unfinished_requests():
        sim.step()
    return next(iter(sim.ttft.values()))


def wps(threshold: int, num_requests: int) -> None:
    sim, rng = Sim(threshold), random.Random(0)
    sent = 0
    while sent < 48:
        sim.add(128, 96, -10 if rng.random() < 0.15 else 10)
        sent += 1
    while sim.scheduler.has_unfinished_requests():
        for _ in sim.step():
            if sent < num_requests:
                sim.add(128, 96, -10 if rng.random() < 0.15 else 10)
                sent += 1
    high = [t for rid, t in sim.ttft.items() if sim.priority[rid] == -10]
    low = [t for rid, t in sim.ttft.items() if sim.priority[rid] == 10]
    low_itl = [x for rid, xs in sim.itl.items() if sim.priority[rid] == 10 for x in xs]
    idle, step = idle_ttft(threshold), statistics.median(sim.step_s)
    high_p50 = statistics.median(high)
    print(f"  WPS: -10 TTFT p50 {high_p50 * 1e3:6.0f} ms = idle {idle * 1e3:.0f} ms + "
          f"{(high_p50 - idle) / step:4.1f} loaded steps ({step * 1e3:.0f} ms, the median); "
          f"10 TTFT p50 {statistics.median(low) * 1e3:6.0f} ms; low ITL p50 "
          f"{statistics.median(low_itl) * 1e3:.0f} ms")


def wl(threshold: int) -> None:
    sim = Sim(threshold)
    low = []
    for _ in range(16):  # staggered arrivals: one low prefill at a time
        low.append(sim.add(128, 192, 10))
        for _ in range(3):
            sim.step()
    for _ in range(10):
        sim.step()
    sim.add(2000, 16, -10)
    while sim.scheduler.has_unfinished_requests():
        sim.step()
    itl = [x for rid in low for x in sim.itl[rid]]
    print(f"  WL: low ITL p50 {statistics.median(itl) * 1e3:.0f} ms, p99 {p(itl, 0.99) * 1e3:.0f}"
          f" ms (p99/p50 {p(itl, 0.99) / statistics.median(itl):.1f}), max "
          f"{max(itl) * 1e3:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--thresholds", default="128,0",
                        help="--long-prefill-token-threshold values to try (0: no cap)")
    args = parser.parse_args()
    for threshold in (int(t) for t in args.thresholds.split(",")):
        print(f"long_prefill_token_threshold {threshold}:")
        wps(threshold, args.num_requests)
        wl(threshold)


if __name__ == "__main__":
    main()
