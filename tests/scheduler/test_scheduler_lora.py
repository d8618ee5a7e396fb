"""LoRA adapters in the scheduler: at most --max-loras adapters a step, chosen by the
priority of the requests that want them; loads asked for off the step, evictions of the
least urgent, least recently run; a failed load fails its requests alone."""

from __future__ import annotations

from scheduler.placement import Placement
from scheduler.request import Request, RequestStatus
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from tests.support.scheduler_helpers import make_scheduler, run_until_done, scheduled_ids, step


def lora_request(request_id: str, lora: str | None, priority: int = 0,
                 prompt: list[int] | None = None, max_tokens: int = 4) -> Request:
    return Request(
        request_id, prompt or [1, 2, 3, 4, 5], SamplingParams(max_tokens=max_tokens),
        placement=Placement(priority=priority, lora_name=lora),
    )


def loras_of(scheduler: Scheduler, ids: list[str]) -> set[str | None]:
    return {scheduler.requests[i].lora_name for i in ids if i in scheduler.requests}


def priority_scheduler(max_loras: int, max_cpu_loras: int | None = None,
                       loaded: tuple[str, ...] = ()) -> Scheduler:
    scheduler = make_scheduler(policy="priority", max_loras=max_loras,
                               max_cpu_loras=max_cpu_loras)
    for name in loaded:
        scheduler.lora_loaded(name)
    return scheduler


def test_the_two_adapters_of_the_most_urgent_requests_run():
    scheduler = priority_scheduler(max_loras=2, max_cpu_loras=3, loaded=("a", "b", "c"))
    for request in [lora_request("a0", "a", priority=5), lora_request("b0", "b", priority=0),
                    lora_request("c0", "c", priority=1), lora_request("base", None, 9)]:
        scheduler.add_request(request)
    outputs = run_until_done(scheduler)
    steps_of = {rid: [n for n, o in enumerate(outputs) if rid in scheduled_ids(o)]
                for rid in ("a0", "b0", "c0", "base")}
    assert all(len({s.lora_name for s in o.scheduled} - {None}) <= 2 for o in outputs)
    # a (priority 5) gets a slot only once b (0) or c (1) is done with theirs
    assert steps_of["a0"][0] > min(steps_of["b0"][-1], steps_of["c0"][-1])
    assert steps_of["b0"][0] < steps_of["c0"][0] < steps_of["a0"][0]


def test_an_urgent_request_for_a_cold_adapter_starts_before_a_warm_flood():
    scheduler = priority_scheduler(max_loras=1, max_cpu_loras=2, loaded=("warm",))
    for i in range(6):
        scheduler.add_request(lora_request(f"flood{i}", "warm", priority=10))
    scheduler.add_request(lora_request("urgent", "cold", priority=-5))
    scheduler.add_request(lora_request("base", None, priority=10))
    out, _ = step(scheduler)
    # the cold adapter loads off the step; its slot is kept: the flood is not admitted,
    # base requests run meanwhile
    assert out.lora_loads == ["cold"] and out.lora_evictions == []
    assert scheduled_ids(out) == ["base"]
    out, _ = step(scheduler)
    assert out.lora_loads == [] and "urgent" not in scheduled_ids(out)
    scheduler.lora_loaded("cold")
    out, _ = step(scheduler)
    assert "urgent" in scheduled_ids(out)
    assert not any(i.startswith("flood") for i in scheduled_ids(out))
    outputs = run_until_done(scheduler)
    first_flood = next(n for n, o in enumerate(outputs)
                       if any(i.startswith("flood") for i in scheduled_ids(o)))
    urgent_steps = [n for n, o in enumerate(outputs) if "urgent" in scheduled_ids(o)]
    assert urgent_steps and max(urgent_steps) < first_flood


def test_a_failed_load_fails_its_requests_alone():
    scheduler = priority_scheduler(max_loras=2, loaded=("good",))
    scheduler.add_request(lora_request("bad0", "bad", priority=0))
    scheduler.add_request(lora_request("bad1", "bad", priority=3))
    scheduler.add_request(lora_request("good0", "good", priority=1))
    out, _ = step(scheduler)
    assert out.lora_loads == ["bad"] and scheduled_ids(out) == ["good0"]
    failed = scheduler.lora_failed("bad")
    assert sorted(failed) == ["bad0", "bad1"]
    scheduler.finish_requests(failed, RequestStatus.FINISHED_ABORTED)
    scheduler.check_integrity()
    run_until_done(scheduler)
    assert not scheduler.requests


def test_the_least_urgent_least_recently_run_adapter_is_evicted():
    scheduler = priority_scheduler(max_loras=1, max_cpu_loras=2, loaded=("x", "y"))
    scheduler.add_request(lora_request("x0", "x", priority=1, max_tokens=1))
    run_until_done(scheduler)
    scheduler.add_request(lora_request("y0", "y", priority=1, max_tokens=1))
    run_until_done(scheduler)
    # both idle: x ran longer ago, so it goes for z
    scheduler.add_request(lora_request("z0", "z", priority=0))
    out, _ = step(scheduler)
    assert out.lora_loads == ["z"] and out.lora_evictions == ["x"]
    scheduler.lora_loaded("z")
    run_until_done(scheduler)
    assert set(scheduler.loras.loaded) == {"y", "z"}
    # x again, wanted by a waiting request while y's and z's are not: the one of the
    # worst priority goes first (z's request is less urgent than y's), whatever ran last
    scheduler.add_request(lora_request("y1", "y", priority=2, max_tokens=8))
    scheduler.add_request(lora_request("z1", "z", priority=6, max_tokens=8))
    scheduler.add_request(lora_request("x1", "x", priority=-1, max_tokens=8))
    out, _ = step(scheduler)
    assert out.lora_loads == ["x"] and out.lora_evictions == ["z"]


def test_a_running_request_pauses_while_its_adapter_has_no_slot():
    scheduler = priority_scheduler(max_loras=1, max_cpu_loras=2, loaded=("a", "b"))
    scheduler.add_request(lora_request("slow", "a", priority=5, max_tokens=8))
    out, _ = step(scheduler)
    assert scheduled_ids(out) == ["slow"]
    scheduler.add_request(lora_request("urgent", "b", priority=0, max_tokens=2))
    outputs = run_until_done(scheduler)
    order = [scheduled_ids(o) for o in outputs]
    assert order[0] == ["urgent"] and order[1] == ["urgent"]
    assert all(ids == ["slow"] for ids in order[2:])
    assert "slow" not in scheduler.requests


def test_two_adapters_never_share_prefix_blocks():
    scheduler = priority_scheduler(max_loras=2, loaded=("a", "b"))
    prompt = list(range(10, 30))
    scheduler.add_request(lora_request("a0", "a", prompt=prompt, max_tokens=1))
    run_until_done(scheduler)
    scheduler.add_request(lora_request("b0", "b", prompt=prompt, max_tokens=1))
    scheduler.add_request(lora_request("a1", "a", prompt=prompt, max_tokens=1))
    scheduler.add_request(lora_request("base", None, prompt=prompt, max_tokens=1))
    _, updated = step(scheduler)
    cached = {r.request_id: r.num_cached_tokens for r in updated}
    assert cached["a1"] == 16 and cached["b0"] == 0 and cached["base"] == 0
