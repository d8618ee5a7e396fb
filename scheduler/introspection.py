"""Looking into a scheduler: its stats for metrics, the JSON snapshot behind GET
/scheduler/state, and the integrity check that tests run, and the engine when idle or
asked."""

from __future__ import annotations

from collections import Counter
from dataclasses import astuple, dataclass, field, replace
from typing import Any, Protocol

from kvcache.kv_cache_manager import KVCacheManager
from scheduler.config import SchedulerConfig
from scheduler.lora_slots import LoRASlots
from scheduler.prompt_sharing import PromptSharing
from scheduler.request import Request, RequestStatus
from scheduler.request_queue import RequestQueue, SchedulingPolicy
from scheduler.slo import SloPlanner
from scheduler.speculation import SpecDecodeStats, Speculation


@dataclass(frozen=True)
class SchedulerStats:
    """Counters and gauges for metrics (token counts for the prefix cache); the defaults
    are those of a scheduler that has seen nothing."""

    num_running: int = 0
    num_waiting: int = 0
    num_preemptions_total: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0
    num_blocks: int = 0
    num_waiting_by_priority: dict[int, int] = field(default_factory=dict)
    num_running_by_priority: dict[int, int] = field(default_factory=dict)
    num_preemptions_by_priority: dict[int, int] = field(default_factory=dict)  # cumulative
    spec_decode: SpecDecodeStats | None = None  # None: speculation is off
    # The step-cost model (seconds: per step, per decode row, per prefill token and key)
    # and, under slo, the steps whose decodes alone exceeded their tightest tpot target
    # and the waiting requests refused once late (cumulative). NOTE: not compared: the
    # model changes with every step, and the engine core sends the stats only when they
    # change (`changed_stats`); the fit goes out with the next change instead.
    step_cost: tuple[float, ...] = field(default=(0.0,) * 7, compare=False)
    num_steps_over_tpot: int = 0
    num_rejected_late: int = 0
    # LoRA adapters of running requests, and of waiting ones (vllm:lora_requests_info)
    max_loras: int = 0  # 0: no adapters
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()


class SchedulerState(Protocol):
    """What introspection reads of a scheduler (scheduler.Scheduler)."""

    config: SchedulerConfig
    policy: SchedulingPolicy
    kv_cache: KVCacheManager
    waiting: RequestQueue
    skipped_waiting: RequestQueue
    running: list[Request]
    requests: dict[str, Request]
    sharing: PromptSharing
    loras: LoRASlots | None
    num_preemptions_total: int
    slo: SloPlanner
    speculation: Speculation | None
    _num_preemptions_by_priority: Counter[int]

    @property
    def num_waiting(self) -> int: ...


def stats(state: SchedulerState) -> SchedulerStats:
    """The scheduler's counters and gauges, the fitted step cost among them; O(running +
    held), not O(waiting)."""
    return replace(_counters(state), step_cost=astuple(state.slo.cost))


def changed_stats(state: SchedulerState, last: SchedulerStats | None
                  ) -> SchedulerStats | None:
    """The stats, unless they equal `last` (the step cost aside): the model is solved only
    for stats that go out, so that fcfs and priority steps pay no fit."""
    counters = _counters(state)
    if counters == last:
        return None
    return replace(counters, step_cost=astuple(state.slo.cost))


def _counters(state: SchedulerState) -> SchedulerStats:
    """The stats but the step cost (left at its default)."""
    kv = state.kv_cache
    # NOTE: outside schedule() skipped_waiting is empty: waiting and held are all.
    waiting_by_priority = Counter(state.waiting.count_by_priority())
    waiting_by_priority.update(r.priority for r in state.sharing)
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    if state.loras is not None:
        waiting_by_priority.update(r.priority for r in state.loras.held_requests())
        running = {r.lora_name for r in state.running if r.lora_name is not None}
        running_loras = tuple(sorted(running))
        waiting_loras = tuple(sorted(state.loras.wanted() - running))
    return SchedulerStats(
        num_running=len(state.running),
        num_waiting=state.num_waiting,
        num_preemptions_total=state.num_preemptions_total,
        kv_cache_usage=kv.usage,
        prefix_cache_queries_tokens=kv.prefix_cache_queries_tokens,
        prefix_cache_hits_tokens=kv.prefix_cache_hits_tokens,
        num_free_blocks=kv.num_free_blocks,
        num_cached_blocks=kv.num_cached_blocks,
        num_blocks=kv.num_blocks,
        num_waiting_by_priority=dict(waiting_by_priority),
        num_running_by_priority=dict(Counter(r.priority for r in state.running)),
        num_preemptions_by_priority=dict(state._num_preemptions_by_priority),
        spec_decode=None if state.speculation is None else state.speculation.stats,
        max_loras=0 if state.loras is None else state.loras.max_loras,
        running_loras=running_loras,
        waiting_loras=waiting_loras,
        num_steps_over_tpot=state.slo.num_steps_over_tpot,
        num_rejected_late=state.slo.num_rejected_late,
    )


def snapshot(state: SchedulerState, now: float, max_waiting: int) -> dict[str, Any]:
    """JSON-ready view: policy, running requests, the first `max_waiting` waiting requests
    in policy order (`num_waiting` counts them all) and the KV pool, at time `now`.
    O(running + W log max_waiting)."""
    kv = state.kv_cache
    return {
        "policy": state.policy.value,
        "running": [_describe(state, r, now) for r in state.running],
        "waiting": [_describe(state, r, now) for r in state.waiting.head(max_waiting)],
        "num_waiting": state.num_waiting,
        "kv_cache": {
            "num_blocks": kv.num_blocks,
            "num_free_blocks": kv.num_free_blocks,
            "num_cached_blocks": kv.num_cached_blocks,
            "block_size": kv.block_size,
            "usage": kv.usage,
        },
        "num_preemptions_total": state.num_preemptions_total,
        "step_cost": {**state.slo.cost.as_dict(),
                      "num_steps_observed": state.slo.model.num_observed,
                      "seed": state.slo.model.seed.as_dict(),
                      "calibration_s": state.slo.calibration_s},
    }


def check_integrity(state: SchedulerState) -> None:
    """RuntimeError unless the KV pool is consistent, every request is in exactly one
    queue with a matching status, and only running requests hold blocks. O(blocks +
    requests)."""
    state.kv_cache.check_integrity()
    running_ids = [r.request_id for r in state.running]
    waiting = [*state.waiting, *state.skipped_waiting, *state.sharing]
    if state.loras is not None:
        waiting += state.loras.held_requests()
    all_ids = running_ids + [r.request_id for r in waiting]
    if len(set(all_ids)) != len(all_ids):
        raise RuntimeError("a request is queued twice")
    if set(all_ids) != set(state.requests):
        raise RuntimeError(
            f"queues and request table disagree: {sorted(set(all_ids) ^ set(state.requests))}"
        )
    if len(state.running) > state.config.max_num_seqs:
        raise RuntimeError(f"{len(state.running)} running > max_num_seqs")
    _check_running(state)
    for request in waiting:
        if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            raise RuntimeError(f"{request!r} is in waiting")
        if request.num_computed_tokens:
            raise RuntimeError(f"waiting {request!r} has computed tokens")
    for leader_id in state.sharing.held:
        if leader_id not in state.requests:
            raise RuntimeError(f"requests held back for {leader_id}, which is gone")
    holders = state.kv_cache.holders()
    if not holders <= set(running_ids):
        raise RuntimeError(f"requests not running hold blocks: {holders - set(running_ids)}")


def _check_running(state: SchedulerState) -> None:
    for request in state.running:
        if request.status is not RequestStatus.RUNNING:
            raise RuntimeError(f"{request!r} is in running")
        # NOTE: the table's length: with a sliding window, blocks behind it are released
        num_table = len(state.kv_cache.get_block_ids(request.request_id))
        if num_table * state.kv_cache.block_size < request.num_computed_tokens:
            raise RuntimeError(f"{request!r} has a table of {num_table} blocks: too few")


def _describe(state: SchedulerState, request: Request, now: float) -> dict[str, Any]:
    return {
        "request_id": request.request_id,
        "status": request.status.name,
        "tenant": request.placement.tenant,
        "priority": request.priority,
        "effective_priority": (
            request.effective_priority
            if request.status is RequestStatus.RUNNING
            else state.waiting.effective_priority(request, now)
        ),
        "arrival_time": request.arrival_time,
        "num_prompt_tokens": request.num_prompt_tokens,
        "num_output_tokens": request.num_output_tokens,
        "num_computed_tokens": request.num_computed_tokens,
        "num_blocks": state.kv_cache.num_held_blocks(request.request_id),
        "num_preemptions": request.num_preemptions,
    }
