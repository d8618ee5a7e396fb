"""Goodput under load: fcfs, priority and slo scheduling against latency targets.

`python -m bench.slo [--step-cost FIXED,DECODE,PREFILL[,KEY]] [--duration-s 120]`
simulates the engine: the real Scheduler, its clock advanced by each step's cost under the
step-cost model (seconds per step, per decode row, per prefill token and key: the simulated
runner standing in for the device, with +-5% noise), the CPU server's defaults (128 seats,
512 tokens a step, prefill cap 32). Capacity is the fcfs throughput (requests/s) of a
backlog; then Poisson arrivals at 0.5x, 1x, 1.5x and 2x it, three classes in one load:
interactive (priority 0, ttft 500 ms, tpot 100 ms), standard (priority 0, ttft 3 s) and
background (priority 10, no target), a third each (`--mix` sets other shares), under each
policy in the same run. Goodput: requests/s meeting every target they carry; attainment per
class; throughput.

Every request finishes and background carries no target, so goodput differs between two
policies only by the interactive and standard requests on time. With shares i and s, and
the priority policy's attainment of them g_i and g_s, slo's goodput over priority's is at
most 1 / (1 - i (1 - g_i) - s (1 - g_s)) (slo on time for all, at the same throughput): 1.5
at most for thirds, however late priority is; 2 for half interactive.

`python -m bench.slo --real [--policies priority,slo]` runs the step-size rule on the
real default model in this process (the engine core's own steps): 16 decodes carrying
tpot_ms 100, then a 2,000-token prompt arrives; the decodes' inter-token gaps from its
arrival to its first token (p50, p99, max) and the step-cost model the core fitted.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any

from kvcache.config import CacheConfig
from scheduler.config import SchedulerConfig
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.placement import Placement
from scheduler.request import Request, RequestStatus
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.step_cost import StepCost

POLICIES = ("fcfs", "priority", "slo")
LOADS = (0.5, 1.0, 1.5, 2.0)


@dataclass(frozen=True)
class RequestClass:
    name: str
    share: float
    priority: int
    ttft_ms: int | None
    tpot_ms: int | None
    prompt: tuple[int, int]  # uniform range of prompt tokens
    output: tuple[int, int]  # of output tokens


CLASSES = (
    RequestClass("interactive", 1 / 3, 0, 500, 100, (32, 128), (32, 96)),
    RequestClass("standard", 1 / 3, 0, 3000, None, (128, 512), (64, 192)),
    RequestClass("background", 1 / 3, 10, None, None, (256, 768), (128, 256)),
)


@dataclass
class Arrival:
    at: float
    kind: RequestClass
    num_prompt: int
    num_output: int


@dataclass
class Outcome:
    """What one request got: its first and last token times, its tokens, its status."""

    arrival: Arrival
    first: float | None = None
    last: float | None = None
    num_tokens: int = 0
    rejected: bool = False

    def ttft_met(self) -> bool:
        target = self.arrival.kind.ttft_ms
        return target is None or (
            self.first is not None and self.first - self.arrival.at <= target / 1000)

    def tpot_met(self) -> bool:
        target = self.arrival.kind.tpot_ms
        if target is None:
            return True
        if self.first is None or self.last is None:
            return False
        return (self.last - self.first) / max(self.num_tokens - 1, 1) <= target / 1000

    def good(self) -> bool:
        return not self.rejected and self.ttft_met() and self.tpot_met()


def arrivals(rate: float, duration_s: float, seed: int,
             classes: tuple[RequestClass, ...] = CLASSES) -> list[Arrival]:
    """Poisson arrivals at `rate` requests/s over `duration_s` (rate 0: a backlog of
    duration_s x 10 requests at time 0), each of a class drawn by the classes' shares."""
    rng = random.Random(seed)
    kinds = [c for c in classes for _ in range(round(c.share * 12))]
    out, now = [], 0.0
    count = int(duration_s * 10) if rate == 0 else None
    while True:
        if rate:
            now += rng.expovariate(rate)
            if now > duration_s:
                return out
        elif count is not None and len(out) >= count:
            return out
        kind = rng.choice(kinds)
        out.append(Arrival(now, kind, rng.randint(*kind.prompt), rng.randint(*kind.output)))


@dataclass
class Simulation:
    """One policy's run of one load on the simulated device."""

    policy: str
    cost: StepCost
    seed: int
    now: float = 0.0
    outcomes: dict[str, Outcome] = field(default_factory=dict)

    def run(self, load: list[Arrival]) -> dict[str, Any]:
        scheduler = Scheduler(
            SchedulerConfig(policy=self.policy, max_num_seqs=128, max_num_batched_tokens=512,
                            long_prefill_token_threshold=32, max_model_len=4096,
                            step_cost_seed=self.cost),
            CacheConfig(num_blocks=16384, block_size=16), clock=lambda: self.now)
        rng = random.Random(self.seed)
        pending = list(reversed(load))
        while pending or scheduler.has_unfinished_requests():
            while pending and pending[-1].at <= self.now:
                self._add(scheduler, pending.pop())
            if not scheduler.has_unfinished_requests():
                self.now = pending[-1].at
                continue
            out = scheduler.schedule()
            work = scheduler.last_step_work
            seconds = work.seconds(self.cost)
            seconds *= rng.uniform(0.95, 1.05)
            self.now += seconds
            self._record(scheduler.update(out, _tokens(out)))
            scheduler.observe_step(work, seconds)
        return self._summary(load)

    def _add(self, scheduler: Scheduler, arrival: Arrival) -> None:
        kind = arrival.kind
        request_id = f"r{len(self.outcomes)}"
        placement = Placement(
            priority=0 if self.policy == "fcfs" else kind.priority,
            ttft_deadline=None if kind.ttft_ms is None else arrival.at + kind.ttft_ms / 1000,
            tpot_s=None if kind.tpot_ms is None else kind.tpot_ms / 1000)
        prompt = [1000 + (len(self.outcomes) * 7919 + j) % 30000
                  for j in range(arrival.num_prompt)]
        params = SamplingParams(max_tokens=arrival.num_output, ignore_eos=True)
        scheduler.add_request(Request(request_id, prompt, params, placement=placement,
                                      arrival_time=arrival.at))
        self.outcomes[request_id] = Outcome(arrival)

    def _record(self, updated: list[Request]) -> None:
        for request in updated:
            outcome = self.outcomes[request.request_id]
            if request.status is RequestStatus.FINISHED_REJECTED:
                outcome.rejected = True
                continue
            if outcome.first is None:
                outcome.first = self.now
            outcome.last = self.now
            outcome.num_tokens = request.num_output_tokens

    def _summary(self, load: list[Arrival]) -> dict[str, Any]:
        outcomes = list(self.outcomes.values())
        span = max(self.now, max((a.at for a in load), default=0.0))
        summary: dict[str, Any] = {
            "policy": self.policy,
            "goodput": sum(o.good() for o in outcomes) / span,
            "throughput_rps": len(outcomes) / span,
            "tokens_per_s": sum(o.num_tokens for o in outcomes) / span,
        }
        for kind in dict.fromkeys(a.kind for a in load):
            mine = [o for o in outcomes if o.arrival.kind is kind]
            summary[f"{kind.name}_ttft"] = _share(o.ttft_met() for o in mine)
            summary[f"{kind.name}_tpot"] = _share(o.tpot_met() for o in mine)
        return summary


def _share(flags: Any) -> float:
    values = list(flags)
    return sum(values) / len(values) if values else 1.0


def _tokens(out: SchedulerOutput) -> ModelRunnerOutput:
    return ModelRunnerOutput(sampled_token_ids={s.request_id: 42 for s in out.scheduled
                                                if s.sample})


def capacity(cost: StepCost, duration_s: float, seed: int,
             classes: tuple[RequestClass, ...]) -> float:
    """Requests/s of a backlog of this mix under fcfs."""
    backlog = arrivals(0.0, duration_s, seed, classes)
    return float(Simulation("fcfs", cost, seed).run(backlog)["throughput_rps"])


def simulate(cost: StepCost, duration_s: float, seed: int, loads: tuple[float, ...],
             classes: tuple[RequestClass, ...] = CLASSES) -> None:
    rate = capacity(cost, duration_s, seed, classes)
    print("mix: " + ", ".join(f"{c.name} {c.share:.2f}" for c in classes))
    print(f"step cost {cost}; capacity {rate:.2f} requests/s (fcfs, backlog)")
    header = ("load", "policy", "goodput", "thr r/s", "tok/s", "int ttft", "int tpot",
              "std ttft")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for load in loads:
        arrivals_ = arrivals(rate * load, duration_s, seed + 1, classes)
        for policy in POLICIES:
            s = Simulation(policy, cost, seed).run(arrivals_)
            print(f"| {load:g}x | {policy} | {s['goodput']:.2f} | {s['throughput_rps']:.2f} | "
                  f"{s['tokens_per_s']:.0f} | {100 * s['interactive_ttft']:.1f}% | "
                  f"{100 * s['interactive_tpot']:.1f}% | {100 * s['standard_ttft']:.1f}% |")


def real_step_rule(policies: list[str], tpot_ms: int) -> None:
    """The step-size rule on the default model (see the module docstring)."""
    from engine.core import EngineCore
    from engine.core_process import freeze_startup_objects
    from engine.core_setup import build_core_parts
    from engine.messages import AddRequests, NewRequest
    from model_runner.config import ModelConfig

    for policy in policies:
        model_config = ModelConfig(max_num_seqs=128, max_num_batched_tokens=512, device="cpu")
        scheduler_config = SchedulerConfig(policy=policy, max_num_seqs=128,
                                           max_num_batched_tokens=512,
                                           long_prefill_token_threshold=32,
                                           calibrate_step_cost=policy == "slo")
        scheduler, runner, info, _ = build_core_parts(model_config, scheduler_config)
        core = EngineCore(scheduler, runner, frozenset(info.eos_token_ids))
        freeze_startup_objects()  # as the core process does
        tpot = Placement(tpot_s=tpot_ms / 1000)
        params = SamplingParams(max_tokens=1500, ignore_eos=True)  # past the prompt
        core.apply(AddRequests([NewRequest(request_id=f"d{i}", placement=tpot,
                                           prompt_token_ids=[100 + i + j for j in range(32)],
                                           sampling_params=params) for i in range(16)]))
        steady = []
        for _ in range(40):  # prompts, then steady decoding (and the model's first fit)
            start = time.monotonic()
            core.step_fn()
            steady.append(time.monotonic() - start)
        steady = sorted(steady[4:])
        print(f"{policy}: 16 decodes alone, step median {1000 * statistics.median(steady):.0f}"
              f" ms, max {1000 * steady[-1]:.0f} ms", flush=True)
        long = NewRequest(request_id="long", prompt_token_ids=[(7 * j) % 5000 + 200
                                                               for j in range(2000)],
                          sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))
        arrived = time.monotonic()
        core.apply(AddRequests([long]))
        gaps, last, first_long, chunks = [], time.monotonic(), None, []
        errors: dict[bool, list[float]] = {False: [], True: []}  # late chunk: actual/planned
        while first_long is None:
            context, cost = scheduler.requests["long"].num_computed_tokens, scheduler.slo.cost
            start = time.monotonic()
            deltas = core.step_fn().deltas
            now = time.monotonic()
            errors[context >= 1000].append((now - start) / scheduler.last_step_work.seconds(cost))
            chunks.append(scheduler.last_step_work.prefill_tokens)
            if any(d.request_id.startswith("d") for d in deltas):
                gaps.append(now - last)
                last = now
            if any(d.request_id == "long" and d.new_token_ids for d in deltas):
                first_long = now - arrived
        gaps.sort()
        p99 = gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]
        print(f"{policy}: {len(gaps)} decode steps while the prompt was computed; gap p50 "
              f"{1000 * statistics.median(gaps):.0f} ms, p99 {1000 * p99:.0f} ms, max "
              f"{1000 * gaps[-1]:.0f} ms; the prompt's TTFT {first_long:.2f} s in "
              f"{len(chunks)} steps (chunk median {statistics.median(chunks):.0f} tokens); "
              f"steps over target {scheduler.slo.num_steps_over_tpot}; margin at the end "
              f"{1000 * scheduler.slo.margin(tpot_ms / 1000, True):.1f} ms with prefill, "
              f"{1000 * scheduler.slo.margin(tpot_ms / 1000, False):.1f} decode-only; "
              f"calibrated in "
              f"{scheduler.slo.calibration_s} s: {scheduler.slo.model.seed}; fitted "
              f"{scheduler.slo.cost}; a step's time / the model's prediction before it ran, "
              f"median: context < 1,000 {statistics.median(errors[False]):.2f}, later "
              f"{statistics.median(errors[True]):.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.slo",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--step-cost", default="0.02,0.001,0.0005",
                        help="FIXED,DECODE,PREFILL[,KEY] seconds (KEY: per key a prefill "
                        "token attends to; PREFILL/2048 by default; fit it with --real)")
    parser.add_argument("--duration-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loads", default=",".join(map(str, LOADS)))
    parser.add_argument("--mix", default=None,
                        help="INTERACTIVE,STANDARD,BACKGROUND shares in twelfths (4,4,4: "
                        "thirds, the default; 6,3,3: half interactive)")
    parser.add_argument("--real", action="store_true",
                        help="the step-size rule on the real default model instead")
    parser.add_argument("--policies", default="priority,slo", help="for --real")
    parser.add_argument("--tpot-ms", type=int, default=100, help="for --real")
    parser.add_argument("--threads", type=int, default=None,
                        help="for --real: torch.set_num_threads")
    args = parser.parse_args()
    if args.real:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        real_step_rule(args.policies.split(","), args.tpot_ms)
        return
    coefficients = [float(x) for x in args.step_cost.split(",")]
    if len(coefficients) == 3:  # a token at context 2,048 costs two
        coefficients.append(coefficients[2] / 2048)
    loads = tuple(float(x) for x in args.loads.split(","))
    simulate(StepCost(*coefficients), args.duration_s, args.seed, loads, _mix(args.mix))


def _mix(text: str | None) -> tuple[RequestClass, ...]:
    if text is None:
        return CLASSES
    twelfths = [int(x) for x in text.split(",")]
    if len(twelfths) != len(CLASSES) or sum(twelfths) != 12 or min(twelfths) < 0:
        raise SystemExit(f"--mix {text}: three shares in twelfths that add up to 12")
    return tuple(replace(c, share=t / 12) for c, t in zip(CLASSES, twelfths, strict=True))


if __name__ == "__main__":
    main()
