"""Helpers for scheduler tests: build a scheduler and requests, fake the model runner."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcache.config import CacheConfig
from scheduler.config import SchedulerConfig, SpeculativeConfig
from scheduler.output import ModelRunnerOutput, SampleLogprobs, ScheduledRequest, SchedulerOutput
from scheduler.placement import Placement
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler

TokenFn = Callable[[ScheduledRequest], int]


class FakeClock:
    """A settable clock for the scheduler (seconds)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_scheduler(
    *,
    policy: str = "fcfs",
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    priority_aging_s: float | None = None,
    priority_aging_floor: int = 0,
    watermark: float = 0.0,
    long_prefill_token_threshold: int = 0,
    num_blocks: int = 32,
    block_size: int = 4,
    enable_prefix_caching: bool = True,
    sliding_window: int | None = None,
    fair_share: bool = False,
    clock: Callable[[], float] | None = None,
    speculative: SpeculativeConfig | None = None,
    max_loras: int | None = None,
    max_cpu_loras: int | None = None,
    background_priority: int | None = None,
) -> Scheduler:
    """A scheduler on a small pool (defaults: 32 blocks of 4 tokens, budget 64, 16 seats)."""
    return Scheduler(
        SchedulerConfig(
            policy=policy,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            priority_aging_s=priority_aging_s,
            priority_aging_floor=priority_aging_floor,
            watermark=watermark,
            long_prefill_token_threshold=long_prefill_token_threshold,
            fair_share=fair_share,
            speculative=speculative,
            max_loras=max_loras,
            max_cpu_loras=max_cpu_loras,
            background_priority=background_priority,
        ),
        CacheConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            sliding_window=sliding_window,
        ),
        clock=clock if clock is not None else FakeClock(),
    )


def make_requests(
    n: int,
    num_tokens: int,
    max_tokens: int,
    *,
    priorities: Sequence[int] | None = None,
    prefix: Sequence[int] = (),
    ignore_eos: bool = True,
    min_tokens: int = 0,
    stop_token_ids: tuple[int, ...] = (),
    eos_token_ids: frozenset[int] = frozenset(),
    first_id: int = 0,
    first_arrival: float = 0.0,
) -> list[Request]:
    """`n` requests "r{i}" of `num_tokens` prompt tokens (`prefix`, then tokens unique to
    the request), arriving 1 s apart from `first_arrival`."""
    requests = []
    for k in range(n):
        i = first_id + k
        tail = [10_000 * (i + 1) + j for j in range(num_tokens - len(prefix))]
        requests.append(
            Request(
                request_id=f"r{i}",
                prompt_token_ids=[*prefix, *tail],
                sampling_params=SamplingParams(
                    max_tokens=max_tokens,
                    min_tokens=min_tokens,
                    stop_token_ids=stop_token_ids,
                    ignore_eos=ignore_eos,
                ),
                eos_token_ids=eos_token_ids,
                placement=Placement(priority=priorities[k] if priorities is not None else 0),
                arrival_time=first_arrival + k,
            )
        )
    return requests


def fake_token(scheduled: ScheduledRequest) -> int:
    """A token that depends only on the request and the position it is sampled at, so a
    recomputed request samples the same tokens as an undisturbed one."""
    return 7 + (sum(map(ord, scheduled.request_id)) * 31 + scheduled.context_len) % 500


def make_runner_output(
    scheduler_output: SchedulerOutput,
    token_fn: TokenFn = fake_token,
    with_logprobs: bool = False,
) -> ModelRunnerOutput:
    """What a runner would return: one token per request with sample=True."""
    output = ModelRunnerOutput()
    for scheduled in scheduler_output.scheduled:
        if scheduled.sample:
            token_id = token_fn(scheduled)
            output.sampled_token_ids[scheduled.request_id] = token_id
            if with_logprobs:
                output.logprobs[scheduled.request_id] = SampleLogprobs(-0.5, [(token_id, -0.5)])
    return output


def step(
    scheduler: Scheduler, token_fn: TokenFn = fake_token
) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step with a fake runner, checking integrity after it: the step's output
    and the requests update() returned."""
    out = scheduler.schedule()
    updated = scheduler.update(out, make_runner_output(out, token_fn))
    scheduler.check_integrity()
    return out, updated


def run_until_done(
    scheduler: Scheduler, token_fn: TokenFn = fake_token, max_steps: int = 1000
) -> list[SchedulerOutput]:
    """Step until no request is left; the outputs of every step."""
    outputs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        outputs.append(step(scheduler, token_fn)[0])
    raise AssertionError(f"not done after {max_steps} steps")


def scheduled_ids(scheduler_output: SchedulerOutput) -> list[str]:
    """Ids of the scheduled requests, in batch order."""
    return [s.request_id for s in scheduler_output.scheduled]


def num_tokens_by_id(scheduler_output: SchedulerOutput) -> dict[str, int]:
    """Tokens to compute per scheduled request id."""
    return {s.request_id: s.num_new_tokens for s in scheduler_output.scheduled}


def add_all(scheduler: Scheduler, requests: list[Request]) -> None:
    """Add `requests` to `scheduler`, in order."""
    for request in requests:
        scheduler.add_request(request)
