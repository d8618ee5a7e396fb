"""Random arrivals, priorities, aborts and steps on a tiny pool: invariants hold throughout.

After every step: every block and request is accounted for; no decode starves behind a
prefill; the prefill tokens beside decodes stay within the cap; and, where KV blocks and
seats are plenty (so only the budget binds), no waiting request was denied budget that a
prefill of worse priority got, and a step's prefills are of one priority level; with fair
share among tenants, no waiting request of a level was passed over for one of the same
level with a later fair-share tag.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.output import PLACEHOLDER_TOKEN_ID, SchedulerOutput
from scheduler.placement import Placement
from scheduler.request import Request, RequestStatus
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from tests.support.scheduler_helpers import FakeClock, make_runner_output, make_scheduler

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
        "long_prefill_token_threshold": st.sampled_from([0, 0, 3]),
        "fair_share": st.booleans(),
    }
)

# Only the token budget binds: blocks and seats for every request at once.
ample_configs = st.fixed_dictionaries(
    {
        "policy": st.just("priority"),
        "num_blocks": st.just(1024),
        "block_size": st.integers(1, 4),
        "max_num_seqs": st.just(64),
        "max_num_batched_tokens": st.integers(1, 12),
        "enable_prefix_caching": st.booleans(),
        "priority_aging_s": st.sampled_from([None, 3.0]),
        "long_prefill_token_threshold": st.sampled_from([0, 3]),
        "fair_share": st.booleans(),
    }
)

# One arrival: prompt from a tiny alphabet (so shared prefixes are common), max_tokens,
# priority, steps to run after it, and maybe an abort of some request (by index), either
# between steps or between a schedule() and its update(); and its number of choices
# (n > 1: the later ones name the first as their prompt leader).
arrivals = st.lists(
    st.tuples(
        st.lists(st.integers(1, 3), min_size=1, max_size=24),
        st.integers(1, 16),
        st.integers(0, 3),
        st.sampled_from([0, 0, 0, 1, 2, 4]),
        st.none() | st.none() | st.tuples(st.integers(0, 50), st.booleans()),
        st.sampled_from([1, 1, 1, 2, 3]),
    ),
    min_size=1,
    max_size=16,
)


# Tenants (by a prompt's first token) and their fair-share weights.
TENANT_WEIGHTS = {1: ("a", 1.0), 2: ("b", 2.0), 3: ("c", 0.5)}


def expected_token(request_id: str, position: int) -> int:
    """What `fake_token` samples for a request at a position (context length)."""
    return 7 + (sum(map(ord, request_id)) * 31 + position) % 500


@dataclass
class Harness:
    """Steps the scheduler: plain (schedule, update) or, with `overlapped`, as the engine
    core's overlapped steps do (schedule n + 1, then update n)."""

    scheduler: Scheduler
    clock: FakeClock
    only_budget_binds: bool = False
    overlapped: bool = False
    added: list[Request] = field(default_factory=list)
    aborted: set[str] = field(default_factory=set)
    finished_ids_seen: list[str] = field(default_factory=list)
    in_flight: SchedulerOutput | None = None

    @property
    def live_ids(self) -> set[str]:
        return {r.request_id for r in self.added if not r.is_finished}

    def add(self, prompt: list[int], max_tokens: int, priority: int, num_choices: int) -> None:
        max_len = self.scheduler.max_request_len
        prompt = prompt[: max_len - 1]
        leader_id = f"r{len(self.added)}"
        tenant, weight = TENANT_WEIGHTS[prompt[0]]
        placement = Placement(priority=priority, tenant=tenant, weight=weight)
        for i in range(num_choices):
            request = Request(
                f"r{len(self.added)}",
                prompt,
                SamplingParams(
                    max_tokens=min(max_tokens, max_len - len(prompt)), ignore_eos=True
                ),
                placement=placement,
                arrival_time=self.clock.now,
                prompt_leader_id=leader_id if i else None,
            )
            self.scheduler.add_request(request)
            self.added.append(request)

    def abort(self, index: int) -> None:
        if self.added:
            request = self.added[index % len(self.added)]
            if self.scheduler.finish_requests(
                [request.request_id], RequestStatus.FINISHED_ABORTED
            ):
                self.aborted.add(request.request_id)

    def step(self, abort_index: int | None = None) -> None:
        scheduler = self.scheduler
        running_before = {r.request_id for r in scheduler.running}
        decodes_before = {
            r.request_id for r in scheduler.running
            if r.num_tokens + r.num_output_placeholders - r.num_computed_tokens == 1
            and not (r.num_output_placeholders and scheduler._pending_token_ends(r))
        }
        waiting_before = list(scheduler.waiting)
        num_batch = min(len(scheduler.requests), scheduler.config.max_num_seqs)
        out = scheduler.schedule()
        self.check_output(out, running_before)
        self.check_budget_order(out, decodes_before, waiting_before, num_batch)
        if abort_index is not None:
            self.abort(abort_index)
        if self.overlapped:
            out, self.in_flight = self.in_flight, out
        if out is not None:
            self.scheduler.update(out, make_runner_output(out))
        self.clock.now += 1.0
        self.check_state()

    def drain(self) -> None:
        """Step until nothing is left, in flight or unfinished."""
        for _ in range(MAX_DRAIN_STEPS):
            if not self.scheduler.has_unfinished_requests() and self.in_flight is None:
                return
            if self.overlapped and not self.scheduler.has_unfinished_requests():
                out, self.in_flight = self.in_flight, None  # the last step's update
                self.scheduler.update(out, make_runner_output(out))
                continue
            self.step()

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
            # the token an unfinished step samples is a placeholder (overlapped steps only)
            pending = request.num_output_placeholders - s.sample
            assert pending == 0 or self.overlapped
            known = request.all_token_ids[s.num_computed_tokens : s.context_len]
            assert s.token_ids == known + [PLACEHOLDER_TOKEN_ID] * (s.num_new_tokens - len(known))
            assert s.sample == (s.context_len == request.num_tokens + pending)
            assert len(s.block_table) * block_size >= s.context_len
        self.finished_ids_seen += out.finished_ids

    def check_budget_order(
        self, out: SchedulerOutput, decodes_before: set[str], waiting_before: list[Request],
        num_batch: int,
    ) -> None:
        """Decodes come first and never starve behind a prefill; prefill tokens beside
        decodes stay within the cap of a batch of `num_batch`; where only the budget
        binds, a prefill never gets budget a more urgent waiting request is denied."""
        scheduler = self.scheduler
        ids = [s.request_id for s in out.scheduled]
        is_decode = [i in decodes_before for i in ids]
        assert is_decode == sorted(is_decode, reverse=True), "a prefill before a decode"
        starved = decodes_before - set(ids) - set(out.preempted_ids)
        if starved:
            assert all(is_decode), f"decodes {starved} starved behind a prefill"
            assert out.num_scheduled_tokens == scheduler.config.max_num_batched_tokens
        num_decodes = sum(is_decode)
        threshold = scheduler.config.long_prefill_token_threshold
        if threshold and num_decodes:
            num_prefill = out.num_scheduled_tokens - num_decodes
            # (a prompt being admitted may go whole within the slack of the room left)
            config = scheduler.config
            cap = max(threshold, config.prefill_tokens_per_request * num_batch)
            cap *= config.whole_prompt_slack
            assert num_prefill <= cap, f"{num_prefill} prefill tokens in a batch of {num_batch}"
        if not self.only_budget_binds:
            return
        prefills = [
            scheduler.requests.get(i) or next(r for r in self.added if r.request_id == i)
            for i in ids
            if i not in decodes_before
        ]
        if not prefills:
            return
        now = self.clock.now
        self.check_fair_order(prefills, running_ids=set(ids), waiting_before=waiting_before)
        levels = {r.effective_priority for r in prefills}
        assert len(levels) == 1, f"prefills of levels {levels} in one step"
        worst = max(levels)
        for request in waiting_before:
            if request.request_id in ids or request.is_finished:
                continue
            effective = scheduler.waiting.effective_priority(request, now)
            assert effective >= worst, (
                f"{request!r} (effective {effective}) waited while a prefill of "
                f"effective priority {worst} got budget"
            )

    def check_fair_order(
        self, prefills: list[Request], running_ids: set[str], waiting_before: list[Request]
    ) -> None:
        """With fair share (and no aging), a level's waiting requests are admitted in
        fair-share tag order: none left waiting has an earlier tag than one admitted."""
        scheduler = self.scheduler
        if scheduler.fair_share is None or scheduler.config.priority_aging_s is not None:
            return
        admitted = [r for r in prefills if r in waiting_before]
        for request in admitted:
            assert request.fair_tag is not None
            for other in waiting_before:
                if other.request_id in running_ids or other.is_finished:
                    continue
                if other.priority == request.priority:
                    assert (other.fair_tag, other.request_id) > (
                        request.fair_tag, request.request_id
                    ), f"{other!r} (tag {other.fair_tag}) passed over for {request!r}"

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
    run_workload(config, arrivals, only_budget_binds=False)


@settings(max_examples=60, deadline=None)
@given(config=ample_configs, arrivals=arrivals)
def test_budget_goes_in_priority_order_when_only_the_budget_binds(
    config: dict[str, Any], arrivals: list[tuple[Any, ...]]
) -> None:
    run_workload(config, arrivals, only_budget_binds=True)


@settings(max_examples=60, deadline=None)
@given(config=configs, arrivals=arrivals)
def test_overlapped_steps_keep_invariants_and_finish(
    config: dict[str, Any], arrivals: list[tuple[Any, ...]]
) -> None:
    """Step n + 1 scheduled before step n's update: no token lost or extra (every output is
    the position's expected token, to max_tokens exactly), no block leaked."""
    run_workload(config, arrivals, only_budget_binds=False, overlapped=True)


def run_workload(
    config: dict[str, Any], arrivals: list[tuple[Any, ...]], only_budget_binds: bool,
    overlapped: bool = False,
) -> None:
    clock = FakeClock()
    harness = Harness(make_scheduler(clock=clock, **config), clock, only_budget_binds,
                      overlapped)
    for prompt, max_tokens, priority, num_steps, abort, num_choices in arrivals:
        harness.add(prompt, max_tokens, priority, num_choices)
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
    harness.drain()
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
