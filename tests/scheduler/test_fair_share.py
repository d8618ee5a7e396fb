"""Fair share among tenants inside a priority level, deadlines, and per-salt prefix
caching, at the scheduler level."""

from __future__ import annotations

import itertools
from collections import Counter

from scheduler.placement import Placement
from scheduler.request import Request, RequestStatus
from scheduler.sampling_params import SamplingParams
from tests.support.scheduler_helpers import FakeClock, make_scheduler, run_until_done, step

_fresh_tokens = itertools.count(1000)


def request(request_id: str, tenant: str, *, weight: float = 1.0, priority: int = 0,
            num_tokens: int = 8, max_tokens: int = 4, arrival: float = 0.0,
            deadline: float | None = None, cache_salt: str | None = None,
            prompt: list[int] | None = None) -> Request:
    tokens = prompt or [next(_fresh_tokens) for _ in range(num_tokens)]  # no prefix hits
    placement = Placement(priority=priority, tenant=tenant, weight=weight, deadline=deadline,
                          cache_salt=cache_salt)
    return Request(request_id, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   placement=placement, arrival_time=arrival)


def admission_order(scheduler, max_steps: int = 2000) -> list[str]:
    order: list[str] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return order
        out, _ = step(scheduler)
        order += [s.request_id for s in out.scheduled
                  if s.num_computed_tokens == 0 and s.request_id not in order]
    raise AssertionError("not done")


def fair_scheduler(**kwargs):
    return make_scheduler(policy="priority", fair_share=True, num_blocks=256,
                          max_num_batched_tokens=64, **kwargs)


def test_tenants_are_served_in_proportion_to_their_weights() -> None:
    scheduler = fair_scheduler(max_num_seqs=2)
    # A's burst arrives first, all of it; B's requests after. By arrival, B would wait.
    for i in range(30):
        scheduler.add_request(request(f"a{i}", "A", weight=2.0, arrival=i * 0.01))
    for i in range(30):
        scheduler.add_request(request(f"b{i}", "B", weight=1.0, arrival=1 + i * 0.01))
    order = admission_order(scheduler)
    first = Counter(r[0] for r in order[:30])
    assert abs(first["a"] - 20) <= 1 and abs(first["b"] - 10) <= 1, first


def test_a_burst_does_not_push_another_tenant_to_the_back() -> None:
    scheduler = fair_scheduler(max_num_seqs=4)
    for i in range(200):
        scheduler.add_request(request(f"a{i}", "A", arrival=i * 0.001))
    run = [step(scheduler) for _ in range(3)]
    assert run
    scheduler.add_request(request("b0", "B", arrival=5.0))
    order = admission_order(scheduler)
    # B enters at the level's virtual time: behind what A has running or next, not
    # behind A's 190-odd queued requests.
    assert order.index("b0") <= 12, order.index("b0")


def test_priority_stays_strict_across_levels() -> None:
    scheduler = fair_scheduler(max_num_seqs=1)
    for i in range(5):
        scheduler.add_request(request(f"a{i}", "A", weight=100.0, priority=0))
    scheduler.add_request(request("b-low", "B", priority=5))
    scheduler.add_request(request("b-urgent", "B", priority=-1, arrival=9.0))
    order = admission_order(scheduler)
    assert order[0] == "b-urgent" and order[-1] == "b-low"


def test_without_fair_share_a_level_goes_by_arrival() -> None:
    scheduler = make_scheduler(policy="priority", num_blocks=256, max_num_seqs=1)
    for i in range(4):
        scheduler.add_request(request(f"a{i}", "A", arrival=i))
    scheduler.add_request(request("b0", "B", arrival=10))
    assert admission_order(scheduler) == ["a0", "a1", "a2", "a3", "b0"]


def test_a_waiting_request_past_its_deadline_finishes_uncomputed() -> None:
    clock = FakeClock()
    scheduler = make_scheduler(policy="priority", max_num_seqs=1, clock=clock)
    scheduler.add_request(request("busy", "A", max_tokens=10))
    scheduler.add_request(request("late", "A", deadline=2.5))
    for _ in range(3):
        out, updated = step(scheduler)
        assert "late" not in [s.request_id for s in out.scheduled]
        clock.now += 1.0
    out, updated = step(scheduler)  # now 3.0: past the deadline
    late = scheduler.requests.get("late")
    assert late is None
    expired = [r for r in updated if r.request_id == "late"]
    assert expired and expired[0].status is RequestStatus.FINISHED_DEADLINE
    assert expired[0].finish_reason == "deadline" and expired[0].num_output_tokens == 0
    assert "late" not in [s.request_id for s in out.scheduled]
    run_until_done(scheduler)
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_a_running_request_past_its_deadline_ends_with_its_tokens() -> None:
    clock = FakeClock()
    scheduler = make_scheduler(policy="priority", clock=clock)
    scheduler.add_request(request("r", "A", max_tokens=50, deadline=3.5))
    for _ in range(4):
        step(scheduler)
        clock.now += 1.0
    out, updated = step(scheduler)
    assert "r" not in [s.request_id for s in out.scheduled]
    (expired,) = [r for r in updated if r.request_id == "r"]
    assert expired.status is RequestStatus.FINISHED_DEADLINE
    assert expired.num_output_tokens == 4  # the tokens of the steps before the deadline
    assert "r" in out.finished_ids  # the runner forgets it at once
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_prefix_cache_hits_only_under_the_same_salt() -> None:
    scheduler = make_scheduler(policy="priority", block_size=4, num_blocks=64)
    prompt = list(range(100, 117))  # four full blocks and one token
    scheduler.add_request(request("first", "A", prompt=prompt, cache_salt="alpha"))
    run_until_done(scheduler)
    for request_id, salt, expected in (("other-salt", "beta", 0), ("unsalted", None, 0),
                                       ("same-salt", "alpha", 16)):
        scheduler.add_request(request(request_id, "B", prompt=prompt, cache_salt=salt))
        step(scheduler)
        assert scheduler.requests[request_id].num_cached_tokens == expected, request_id
        run_until_done(scheduler)
