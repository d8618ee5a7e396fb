"""Admission of waiting requests and preemption of running ones, for the Scheduler.

`AdmissionAndPreemption` holds the Scheduler's methods that admit a waiting request (into
a seat and blocks, parking it when it does not fit) and preempt running requests (for a
decode's growth, or under priority for a more urgent admission); the Scheduler
(scheduler.py) holds the state they read, declared here. `Step` is one schedule() call's
bookkeeping: its budget (scheduler/budget.py) and where admission stands.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvcache.block_pool import KVCacheBlock
from kvcache.kv_cache_manager import KVCacheManager, cdiv
from scheduler.budget import StepBudget
from scheduler.config import SchedulerConfig
from scheduler.fair_share import FairShare
from scheduler.lora_slots import LoRASlots
from scheduler.prompt_sharing import PromptSharing
from scheduler.request import Request, RequestStatus
from scheduler.request_queue import RequestQueue, SchedulingPolicy
from scheduler.slo import SloPlanner


@dataclass(kw_only=True)
class Step(StepBudget):
    """Bookkeeping of one schedule() call: its budget, and where admission stands."""

    now: float
    preempted: list[Request] = field(default_factory=list)
    # Set once a running request's growth preempted: under priority, only requests more
    # urgent than this are admitted from then on; under fcfs nobody is.
    must_beat: int | None = None
    # The waiting head that could not be admitted (then only preempting admissions go on,
    # leaving it `num_reserved_blocks` free blocks), and whether admission is over.
    parked_head: Request | None = None
    num_reserved_blocks: int = 0
    admission_closed: bool = False
    # Under priority: the level of the step's first prefill work; worse levels wait.
    prefill_level: int | None = None


def _priority_key(request: Request) -> tuple[int, float, str]:
    return (request.priority, request.arrival_time, request.request_id)


def pick_lowest_priority(requests: Iterable[Request]) -> Request:
    """Priority victim: the request with the largest (priority, arrival time).

    NOTE: the base priority, never the aged one: victims then follow one fixed order, so
    the most urgent running request always runs to its end (no preemption ping-pong).
    """
    return max(requests, key=_priority_key)


def pick_latest_admitted(running: Sequence[Request]) -> Request:
    """FCFS victim: the most recently admitted request (`running` is in admission order)."""
    return running[-1]


class AdmissionAndPreemption:
    """Admission and preemption; mixed into the Scheduler, which sets the state below."""

    config: SchedulerConfig
    policy: SchedulingPolicy
    kv_cache: KVCacheManager
    waiting: RequestQueue
    skipped_waiting: RequestQueue
    running: list[Request]
    requests: dict[str, Request]
    sharing: PromptSharing
    loras: LoRASlots | None
    fair_share: FairShare | None
    num_preemptions_total: int
    _num_preemptions_by_priority: Counter[int]
    _watermark_blocks: int
    slo: SloPlanner

    def _next_candidate(self, step: Step) -> Request | None:
        """The waiting request to consider next, or None while admission is closed.

        Before a head is parked: the head of `waiting` (unless the pool went short and it
        is not urgent enough, or it was itself preempted in this step). After: the request
        of the best base priority, if that could preempt anyone running.
        """
        if step.admission_closed or not self.waiting:
            return None
        if step.parked_head is None:
            candidate = self.waiting.peek()
        else:
            candidate = self.waiting.peek_most_urgent()
            worst_running = max((r.priority for r in self.running), default=None)
            if worst_running is None or candidate.priority >= worst_running:
                return None
        if candidate in step.preempted:
            return None  # it gave its blocks up in this step: no coming straight back
        return candidate

    def _consider(self, request: Request, step: Step) -> None:
        """Try to admit a waiting request; park it (and narrow admission) when it fails.
        One whose adapter cannot run in this step is held aside, parking nobody."""
        self.waiting.remove(request)
        if self.loras is not None and not self.loras.runs(request):
            self.loras.hold(request)
            return
        urgent_enough = step.must_beat is None or request.priority < step.must_beat
        if step.parked_head is None:
            admitted = urgent_enough and self._admit(request, step)
        else:
            admitted = urgent_enough and self._admit_by_preempting(request, step)
        if admitted:
            if self.fair_share is not None:
                self.fair_share.admitted(request)
            return
        self.skipped_waiting.add(request)
        if self.policy is SchedulingPolicy.FCFS or step.parked_head is not None:
            step.admission_closed = True  # NOTE: one try past the head per step bounds it
        else:
            step.parked_head = request
            step.num_reserved_blocks = cdiv(request.num_tokens, self.kv_cache.block_size)

    def _allocate_or_preempt(
        self, request: Request, num_new_tokens: int, step: Step, *, decode: bool = False
    ) -> None:
        """Schedule a running request, preempting victims until its blocks fit (the victim
        may be the request itself: then it is preempted and not scheduled). The pool is
        then short: admission narrows to requests more urgent than every victim."""
        while self.kv_cache.allocate_slots(request, num_new_tokens) is None:
            victim = self._pick_victim(self.running, step)
            self._preempt(victim, step)
            if self.policy is SchedulingPolicy.FCFS:
                step.admission_closed = True
            elif step.must_beat is None or victim.priority < step.must_beat:
                step.must_beat = victim.priority
            if victim is request:
                return
        step.schedule(request, num_new_tokens, decode=decode)

    def _pick_victim(self, candidates: Sequence[Request], step: Step) -> Request:
        """The victim among `candidates` (in `running` order): the latest admitted under
        fcfs, the worst priority under priority, then the most slack under slo."""
        if self.policy is SchedulingPolicy.SLO:
            return self.slo.pick_victim(candidates, step.now)
        if self.policy is SchedulingPolicy.PRIORITY:
            return pick_lowest_priority(candidates)
        return pick_latest_admitted(candidates)

    def _preempt(self, request: Request, step: Step) -> None:
        """Recompute preemption: free the blocks (they stay prefix-cached), forget the
        progress, keep the outputs, and put the request back at the front of waiting."""
        self.kv_cache.free(request)
        self.running.remove(request)
        step.unschedule(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.start_waiting(step.now)
        self.waiting.prepend(request)
        step.preempted.append(request)
        self.num_preemptions_total += 1
        self._num_preemptions_by_priority[request.priority] += 1

    def _admit(self, request: Request, step: Step) -> bool:
        if len(self.running) < self.config.max_num_seqs and self._try_admit(request, step):
            return True
        return self.policy.ranks and self._admit_by_preempting(
            request, step
        )

    def _try_admit(self, request: Request, step: Step) -> bool:
        """Admit `request` if the blocks of all its known tokens fit above the watermark
        (and the blocks reserved for a parked head).

        NOTE: blocks for the whole remaining prompt are taken now, even when the budget
        only lets a chunk of it compute this step: two half-admitted long prompts would
        otherwise preempt each other. Prefix-cache hits (or the prompt leader's blocks)
        count as computed.
        """
        hits, num_cached = self._computed_blocks(request)
        num_new = request.num_tokens - num_cached
        num_now = step.admission_tokens(num_cached, num_new)
        blocks = self.kv_cache.allocate_slots(
            request,
            num_now,
            hits,
            num_lookahead_tokens=num_new - num_now,
            num_reserved_blocks=self._watermark_blocks + step.num_reserved_blocks,
        )
        if blocks is None:
            return False
        if not request.num_output_tokens and not request.num_preemptions:
            request.num_cached_tokens = num_cached
        request.num_computed_tokens = num_cached
        request.status = RequestStatus.RUNNING
        request.stop_waiting(step.now)
        request.effective_priority = self.waiting.effective_priority(request, step.now)
        if self.policy.ranks:
            bisect.insort(self.running, request, key=_priority_key)
        else:
            self.running.append(request)
        step.schedule(request, num_now)
        return True

    def _computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Blocks `request` can take as computed: its prefix-cache hits or, with caching
        off, the full prompt blocks its running prompt leader has computed. None while it
        needs prompt logprobs (NOTE: positions served from the cache have no logits)."""
        if request.needs_prompt_logprobs:
            return [], 0
        hits, num_cached = self.kv_cache.get_computed_blocks(request)
        leader = self.requests.get(request.prompt_leader_id or "")
        if self.kv_cache.enable_caching or leader is None:
            return hits, num_cached
        return self.sharing.leader_blocks(request, leader)

    def _admit_by_preempting(self, request: Request, step: Step) -> bool:
        """Priority admission: preempt the worst running requests of strictly worse
        priority until `request` fits; preempt none if even all of them would not make room.

        "Strictly worse": the running request's base priority is larger than `request`'s
        (its aged priority shields it from nothing). NOTE: so every such preemption goes to
        a strictly better base priority, and two requests can never preempt each other in
        turn.
        A request admitted earlier in this step is a candidate only if aging put it first
        (its base priority is worse): it is then preempted before anything is computed for
        it. Nor can a victim come back
        in this step: `request` takes the room it freed. NOTE: the room check counts every
        block of the request as needed (prefix hits ignored), so it never preempts in vain,
        at the cost of sometimes waiting instead.
        """
        candidates = [r for r in self.running if r.priority > request.priority]
        if not candidates:
            return False
        num_needed = cdiv(request.num_tokens, self.kv_cache.block_size)
        num_room = (
            self.kv_cache.num_free_blocks
            + self.kv_cache.num_blocks_freed_by(candidates)
            - self._watermark_blocks
            - step.num_reserved_blocks
        )
        if num_room < num_needed:
            return False
        while candidates:
            victim = self._pick_victim(candidates, step)
            candidates.remove(victim)
            self._preempt(victim, step)
            if len(self.running) < self.config.max_num_seqs and self._try_admit(request, step):
                return True
        return False
