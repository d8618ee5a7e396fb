"""Random arrivals, priorities, aborts and steps on a tiny pool: invariants hold throughout."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.output import SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from tests.unit.scheduler_helpers import FakeClock, make_runner_output, make_scheduler

MAX_DRAIN_STEPS = 3000

configs = st.fixed_dictionaries(
    {
        "policy": st.sampled_from(["fcfs", "priority"]),
        "num_blocks": st.integers(3, 12),
        "block_size": st.integers(1, 4),
        "max_num_seqs": st.integers(1, 4),
        "max_num_batched_tokens": st.integers(1, 12),
        "enable_prefix_caching": st.booleans(),
        "watermark": st.sampled_from([0.0, 0.2]),
        "priority_aging_s": st.sampled_from([None, 3.0]),
    }
)

# One arrival: prompt from a tiny alphabet (so shared prefixes are common), max_tokens,
# priority, steps to run after it, and maybe an abort of some request (by index), either
# between steps or between a schedule() and its update().
arrivals = st.lists(
    st.tuples(
        st.lists(st.integers(1, 3), min_size=1, max_size=24),
        st.integers(1, 16),
        st.integers(0, 3),
        st.sampled_from([0, 0, 0, 1, 2, 4]),
        st.none() | st.none() | st.tuples(st.integers(0, 50), st.booleans()),
    ),
    min_size=1,
    max_size=16,
)


def expected_token(request_id: str, position: int) -> int:
    """What `fake_token` samples for a request at a position (context length)."""
    return 7 + (sum(map(ord, request_id)) * 31 + position) % 500


@dataclass
class Harness:
    scheduler: Scheduler
    clock: FakeClock
    added: list[Request] = field(default_factory=list)
    aborted: set[str] = field(default_factory=set)
    finished_ids_seen: list[str] = field(default_factory=list)

    @property
    def live_ids(self) -> set[str]:
        return {r.request_id for r in self.added if not r.is_finished}

    def add(self, prompt: list[int], max_tokens: int, priority: int) -> None:
        max_len = self.scheduler.max_request_len
        prompt = prompt[: max_len - 1]
        request = Request(
            f"r{len(self.added)}",
            prompt,
            SamplingParams(max_tokens=min(max_tokens, max_len - len(prompt)), ignore_eos=True),
            priority=priority,
            arrival_time=self.clock.now,
        )
        self.scheduler.add_request(request)
        self.added.append(request)

    def abort(self, index: int) -> None:
        if self.added:
            request = self.added[index % len(self.added)]
            if self.scheduler.abort_requests([request.request_id]):
                self.aborted.add(request.request_id)

    def step(self, abort_index: int | None = None) -> None:
        running_before = {r.request_id for r in self.scheduler.running}
        out = self.scheduler.schedule()
        self.check_output(out, running_before)
        if abort_index is not None:
            self.abort(abort_index)
        self.scheduler.update(out, make_runner_output(out))
        self.clock.now += 1.0
        self.check_state()

    def check_output(self, out: SchedulerOutput, running_before: set[str]) -> None:
        config = self.scheduler.config
        block_size = self.scheduler.cache_config.block_size
        ids = [s.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids)) <= config.max_num_seqs
        assert out.num_scheduled_tokens <= config.max_num_batched_tokens
        assert not set(ids) & set(out.preempted_ids)
        admitted = set(ids) - running_before
        assert not admitted & set(out.preempted_ids), "preempted a request admitted this step"
        for s in out.scheduled:
            request = self.scheduler.requests[s.request_id]
            assert s.num_new_tokens > 0
            assert s.token_ids == request.all_token_ids[s.num_computed_tokens : s.context_len]
            assert s.sample == (s.context_len == request.num_tokens)
            assert len(s.block_table) * block_size >= s.context_len
        self.finished_ids_seen += out.finished_ids

    def check_state(self) -> None:
        self.scheduler.check_integrity()
        assert set(self.scheduler.requests) == self.live_ids  # none lost, none extra
        for request in self.added:
            prompt_len = request.num_prompt_tokens
            assert request.output_token_ids == [
                expected_token(request.request_id, prompt_len + i)
                for i in range(request.num_output_tokens)
            ]


@settings(max_examples=80, deadline=None)
@given(config=configs, arrivals=arrivals)
def test_random_workload_keeps_invariants_and_finishes(
    config: dict[str, Any], arrivals: list[tuple[Any, ...]]
) -> None:
    clock = FakeClock()
    harness = Harness(make_scheduler(clock=clock, **config), clock)
    for prompt, max_tokens, priority, num_steps, abort in arrivals:
        harness.add(prompt, max_tokens, priority)
        for _ in range(num_steps):
            harness.step()
        if abort is not None:
            index, in_step = abort
            if in_step:
                harness.step(abort_index=index)
            else:
                harness.abort(index)
                harness.check_state()

    scheduler = harness.scheduler
    for _ in range(MAX_DRAIN_STEPS):
        if not scheduler.has_unfinished_requests():
            break
        harness.step()
    assert not scheduler.has_unfinished_requests(), "requests left after draining: livelock"

    for request in harness.added:
        if request.request_id in harness.aborted:
            assert request.status is RequestStatus.FINISHED_ABORTED
        else:
            assert request.status is RequestStatus.FINISHED_LENGTH_CAPPED
            assert request.num_output_tokens == request.sampling_params.max_tokens
    kv = scheduler.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and kv.usage == 0.0
    harness.finished_ids_seen += scheduler.schedule().finished_ids
    assert sorted(harness.finished_ids_seen) == sorted(r.request_id for r in harness.added)
