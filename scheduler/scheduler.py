"""The scheduler: which requests compute how many tokens each step, and who is preempted.

One engine step is `out = schedule()`, the runner computes `out`, then `update(out, ...)`.
There are no prefill or decode phases: each request compares `num_computed_tokens` with
`num_tokens`, and one token budget per step covers decodes and (chunked) prefills alike.
schedule() advances `num_computed_tokens` by what it schedules, and a chunk that samples
leaves an output placeholder until update() appends the token. So the next step may be
scheduled before this one's update (overlapped steps, `--async-scheduling`): a request
whose token is still a placeholder decodes it (`PLACEHOLDER_TOKEN_ID` in its token_ids;
the runner takes the token from the previous step's samples on the device), and one
whose pending token ends it (max_tokens, max length) is not scheduled again. update()
still appends the token of a request preempted since it was scheduled.

schedule() spends the budget in one order:
  1. decodes: every running request with one token left, in `running` order (priority
     order under priority; under slo, worse ones without a tpot target sit out the steps
     of a better prompt that can still be on time); when the KV pool is out of blocks, a
     victim is preempted (`pick_lowest_priority` or `pick_latest_admitted`);
  2. prefill work, running chunks and waiting admissions alike, in policy order (under
     fcfs running chunks first, then waiting requests in arrival order; under priority
     one merged order, so that no waiting request is denied budget that a worse-priority
     prefill gets, and within the level of the first prefill, so that worse prefills do
     not lengthen an urgent prompt's step); a step that carries decodes takes at most
     `prefill_cap` prefill tokens in all, a token at a long context counting for more
     and a prompt being admitted just over what is left going whole (scheduler/budget.py),
     so that no prompt, long or many, stalls everyone's stream. Under priority, a
     waiting request that does not fit preempts running requests of strictly worse
     priority (`_admit_by_preempting`). After a preemption for a decode's growth the
     pool is short: only requests more urgent than every victim are admitted (none under
     fcfs).
  With speculative decoding, decodes get draft tokens around step 2 by priority
  (scheduler/speculation.py gives the rule).
  The first waiting request that cannot be admitted is parked in `skipped_waiting`
  (NOTE: strict order: letting a smaller request overtake it would take the blocks it
  waits for and could starve it). Under priority, later requests that would win by
  preempting are still considered, most urgent base priority first, but the free blocks
  stay reserved for the parked head. Parked requests go back to `waiting` at the end of
  the step.

Costs: schedule() and update() are O(running + admitted) per step, whatever the length of
`waiting`; an abort of a waiting request is O(1) (lazy removal).
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from kvcache.config import CacheConfig
from kvcache.kv_cache_manager import KVCacheManager
from scheduler import introspection
from scheduler.admission import AdmissionAndPreemption, Step
from scheduler.budget import prefill_cap
from scheduler.config import SchedulerConfig
from scheduler.fair_share import FairShare
from scheduler.introspection import SchedulerStats
from scheduler.lora_slots import LoRAScheduling, LoRASlots
from scheduler.output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from scheduler.prompt_sharing import PromptSharing
from scheduler.request import Request, RequestStatus, check_stop
from scheduler.request_queue import SchedulingPolicy, SloRequestQueue, create_request_queue
from scheduler.slo import SloPlanner, StepWork, work_of
from scheduler.speculation import Speculation
from scheduler.step_output import build_output


class Scheduler(AdmissionAndPreemption, LoRAScheduling):
    """FCFS or priority continuous batching over a paged KV cache, with preemption.

    `running` is in admission order under fcfs and in priority order under priority.
    `clock` (seconds, time.monotonic by default) times waits for aging; tests inject one.
    Admission and preemption: `AdmissionAndPreemption` (scheduler/admission.py); LoRA
    slots: `LoRAScheduling` (scheduler/lora_slots.py); the budget: scheduler/budget.py.

    Aging (priority_aging_s) orders the waiting queue by effective priority, so a long
    waiter gets ahead of newer, more urgent requests, down to priority_aging_floor or its
    tenant's bound at most. It grants no power to preempt nor shields from it: only a
    strictly better base priority preempts, and victims go by base priority. A request
    keeps the effective priority it was admitted with for the order of its prefill chunks.

    A request still unfinished when its deadline passes is finished with FINISHED_DEADLINE
    at the next schedule() (returned by the next update() with those that got tokens).

    The choices of an n > 1 request compute the prompt once (scheduler/prompt_sharing.py):
    a request naming a `prompt_leader_id` is held back in `sharing` until the leader has
    computed every full block of the prompt, then shares those blocks.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = scheduler_config
        self.cache_config = cache_config
        self.policy = SchedulingPolicy(scheduler_config.policy)
        self.kv_cache = KVCacheManager(cache_config)
        self.slo = SloPlanner(scheduler_config.step_cost_seed)
        self.waiting = create_request_queue(
            self.policy, scheduler_config.priority_aging_s,
            scheduler_config.priority_aging_floor, clock, self.slo.latest_start,
        )
        self.skipped_waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.sharing = PromptSharing(self.kv_cache)  # n > 1: choices held back
        speculative = scheduler_config.speculative
        self.speculation = Speculation(speculative) if speculative is not None else None
        max_loras = scheduler_config.max_loras
        self.loras = None if max_loras is None else LoRASlots(
            max_loras, scheduler_config.max_cpu_loras or max_loras)
        self.num_preemptions_total = 0
        self._num_preemptions_by_priority: Counter[int] = Counter()
        self._finished_ids: list[str] = []
        fair = scheduler_config.fair_share and self.policy.ranks
        self.last_step_work = StepWork()  # of the latest schedule(), for the cost model
        self.fair_share = FairShare() if fair else None
        self._deadlines: list[tuple[float, str]] = []  # a heap of (deadline, request id)
        self._expired: list[Request] = []  # passed their deadline in schedule()
        self._clock = clock
        self._watermark_blocks = int(scheduler_config.watermark * cache_config.num_blocks)
        # NOTE: a request must fit alone in the blocks admission may use, or once preempted
        # it could never be readmitted; so its length is capped by the pool too.
        self.max_request_len = min(
            scheduler_config.max_model_len,
            (cache_config.num_blocks - self._watermark_blocks) * cache_config.block_size,
        )

    # ---- requests in and out ----

    def add_request(self, request: Request) -> None:
        """Queue a new request. ValueError (and nothing queued) if its id is already in
        flight, its prompt is empty, or has max_request_len tokens or more (max_model_len,
        or the KV pool less the watermark): such a prompt could never produce a token,
        and queued it would block every request behind it. A request whose prompt leader
        has not computed the prompt yet is held back until it has."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        if request.status is not RequestStatus.WAITING or request.num_output_tokens:
            raise ValueError(f"request {request.request_id!r} is not a new request")
        if not request.prompt_token_ids:
            raise ValueError("the prompt is empty")
        if request.num_prompt_tokens >= self.max_request_len:
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens is too long: at most "
                f"{self.max_request_len - 1} (max_model_len {self.config.max_model_len}, "
                f"KV pool {self.cache_config.num_blocks} blocks of "
                f"{self.cache_config.block_size} tokens)"
            )
        self.requests[request.request_id] = request
        if self.speculation is not None:
            request.num_speculative_tokens = self.speculation.limit(request.sampling_params)
        if self.fair_share is not None:
            self.fair_share.tag(request)
        if self.loras is not None:
            self.loras.want(request)
        deadline = request.placement.deadline
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, request.request_id))
            if len(self._deadlines) > 2 * len(self.requests) + 1024:  # finished ones linger
                self._deadlines = [d for d in self._deadlines if d[1] in self.requests]
                heapq.heapify(self._deadlines)
        leader = self.requests.get(request.prompt_leader_id or "")
        if not self.sharing.hold(request, leader):
            self.waiting.add(request)

    def finish_requests(
        self, request_ids: Iterable[str] | str, status: RequestStatus
    ) -> list[Request]:
        """Finish requests from outside with a FINISHED_* `status` (e.g. FINISHED_STOPPED
        when the server matched a stop string, FINISHED_ABORTED when its client left).
        Unknown or already finished ids are ignored; blocks are freed and the ids reach
        the runner in the next schedule()'s finished_ids. Returns the requests finished.
        O(1) per waiting request, O(running) once for running ones."""
        if not status.is_finished:
            raise ValueError(f"{status.name} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        finished: list[Request] = []
        any_running = False
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                any_running = True
            else:
                self._unqueue(request)
            self._release(request, status)
            finished.append(request)
        if any_running:
            self.running = [r for r in self.running if not r.is_finished]
        return finished

    # ---- one step ----

    def schedule(self) -> SchedulerOutput:
        """Decide this step's batch: decodes first, then prefill work in policy order."""
        step = Step(self.config, now=self._clock())
        self._expire_deadlines(step.now)
        loads, evictions = self._begin_lora_step()
        self._schedule_decodes(step)
        if self.policy is SchedulingPolicy.SLO:
            self.slo.begin_step([r for r in self.running if r.request_id in step.decode_ids])
        if self.speculation is not None:
            self.speculation.grant_before_prefills(self, step)
        cap = prefill_cap(self.config, len(self.requests), self._has_protected_decodes(step))
        if self.policy is SchedulingPolicy.SLO:
            cap = self.slo.size_prefills(step, work_of(step, self.requests), cap)
        step.prefill_room = cap
        self._schedule_prefills(step)
        if self.speculation is not None:
            self.speculation.grant_after_prefills(self, step)
        parked = [self.skipped_waiting.pop() for _ in range(len(self.skipped_waiting))]
        self.waiting.prepend_requests(parked)
        self.last_step_work = work_of(step, self.requests)
        return self._build_output(step, loads, evictions)

    def update(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Apply a computed step: append the sampled tokens, stop, key full blocks.

        Returns the requests whose deadline passed in schedule(), then those that got a
        token this step (finished ones included), in batch order. Requests finished or
        aborted since schedule() are skipped; one preempted since gets its token (it was
        sampled from the right context). A request that verified drafts gets the accepted
        ones and the runner's own token, up to a stop (scheduler/speculation.py).
        ValueError if the runner returned no token for a request that sampled.
        """
        outputs, self._expired = self._expired, []
        held = self.sharing.held
        any_finished = False
        for scheduled in scheduler_output.scheduled:
            request = self.requests.get(scheduled.request_id)
            if request is None:
                continue
            running = request.status is RequestStatus.RUNNING
            prompt_logprobs = runner_output.prompt_logprobs.get(request.request_id)
            if prompt_logprobs is not None and request.prompt_logprobs is not None:
                request.prompt_logprobs.extend(prompt_logprobs)
            status = None
            if scheduled.sample:
                status = self._append_sampled(request, scheduled, runner_output)
            if running:
                # NOTE: blocks whose KV a later scheduled step computes may be keyed now:
                # every step that could read them runs after that one.
                num_known = min(request.num_computed_tokens, request.num_tokens)
                self.kv_cache.cache_blocks(request, num_known)
                if request.request_id in held and self.sharing.has_computed_prompt(request):
                    self._release_held(request)
            if not scheduled.sample:
                continue
            if status is not None:
                if not running:
                    self._unqueue(request)
                self._release(request, status)
                any_finished = running or any_finished
            outputs.append(request)
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        if runner_output.draft_token_ids and self.speculation is not None:
            self.speculation.keep_proposals(runner_output, self.requests)
        return outputs

    def _append_sampled(
        self, request: Request, scheduled: ScheduledRequest, runner_output: ModelRunnerOutput
    ) -> RequestStatus | None:
        """Append the token(s) a step sampled for `request`: its finished status or None."""
        if scheduled.num_draft_tokens and self.speculation is not None:
            return self.speculation.apply(request, scheduled, runner_output,
                                          self.max_request_len)
        token_id = runner_output.sampled_token_ids.get(request.request_id)
        if token_id is None:
            raise ValueError(f"the runner sampled no token for {request.request_id}")
        request.num_output_placeholders -= 1
        if request.first_token_time is None:
            request.first_token_time = self._clock()
        request.append_output_token(token_id, runner_output.logprobs.get(request.request_id))
        return check_stop(request, self.max_request_len)

    def _expire_deadlines(self, now: float) -> None:
        """Finish every unfinished request whose deadline is past, and (slo) every
        waiting one refused when late whose first token can no longer be on time;
        O(expired log n)."""
        if isinstance(self.waiting, SloRequestQueue):
            late = self.waiting.pop_late_rejects(now)
            for request in late:
                self.requests.pop(request.request_id)  # NOTE: out of the queue already
                request.status = RequestStatus.FINISHED_REJECTED
                self._finished_ids.append(request.request_id)
                self._release_held(request)
            self.slo.num_rejected_late += len(late)
            self._expired.extend(late)
        deadlines = self._deadlines
        expired = []
        while deadlines and deadlines[0][0] <= now:
            _, request_id = heapq.heappop(deadlines)
            if request_id in self.requests:
                expired.append(request_id)
        if expired:
            self._expired.extend(self.finish_requests(expired, RequestStatus.FINISHED_DEADLINE))

    # ---- state ----

    def has_unfinished_requests(self) -> bool:
        """True while any request is running or waiting."""
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        """Requests holding a seat (and blocks)."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission, preempted and held-back ones included."""
        return len(self.requests) - len(self.running)

    @property
    def stats(self) -> SchedulerStats:
        """Counters and gauges for metrics; O(running + held), not O(waiting)."""
        return introspection.stats(self)

    def snapshot(self, max_waiting: int = 100) -> dict[str, Any]:
        """JSON-ready view for GET /scheduler/state: policy, running requests, the first
        `max_waiting` waiting requests in policy order (`num_waiting` counts them all) and
        the KV pool. O(running + W log max_waiting)."""
        return introspection.snapshot(self, self._clock(), max_waiting)

    def check_integrity(self) -> None:
        """RuntimeError unless the KV pool is consistent, every request is in exactly one
        queue with a matching status, and only running requests hold blocks. O(blocks +
        requests): run it when idle or when asked, not every step."""
        introspection.check_integrity(self)

    # ---- scheduling internals ----

    def _schedule_decodes(self, step: Step) -> None:
        """One token for every running request that has one left, in `running` order (slo:
        but those that sit the step out for a better prompt: `SloPlanner.sits_out`)."""
        sits_out = (self.slo.sits_out(self._urgent_prompts(), step.now)
                    if self.policy is SchedulingPolicy.SLO else lambda request: False)
        for request in list(self.running):
            if step.budget == 0:
                return
            if request.status is not RequestStatus.RUNNING or _num_left(request) != 1:
                continue
            if request.num_output_placeholders and self._pending_token_ends(request):
                continue
            if self.loras is not None and not self.loras.runs(request):
                continue  # its adapter has no slot in this step
            if sits_out(request):
                continue
            self._allocate_or_preempt(request, 1, step, decode=True)

    def _urgent_prompts(self) -> list[Request]:
        """The running prompts and the waiting head."""
        head = [self.waiting.peek()] if self.waiting else []
        return [r for r in self.running if _num_left(r) > 1] + head

    def _pending_token_ends(self, request: Request) -> bool:
        """Whether the token `request` is being sampled reaches max_tokens or the length
        cap (then it finishes with that token, whatever it is)."""
        num_outputs = request.num_output_tokens + request.num_output_placeholders
        return (num_outputs >= request.sampling_params.max_tokens
                or request.num_tokens + request.num_output_placeholders >= self.max_request_len)

    def _schedule_prefills(self, step: Step) -> None:
        """Running chunks and waiting admissions in one policy order, while budget lasts.

        Under priority, a step's prefill work stays within one priority level, the first
        one that gets any. NOTE: a step ends when all its work ends, so worse-priority
        prefill tokens in the step of an urgent prompt would delay that prompt's first
        token (a scheduler simulation on a fitted step cost measured TTFT at idle + 2.7
        loaded steps with them, + 0.8 without); they wait for the next step instead.
        """
        chunks = [r for r in self.running if _num_left(r) > 1]
        if self.policy.ranks:
            chunks.sort(key=self._prefill_key(step))
        next_chunk = 0
        while step.has_prefill_room():
            while next_chunk < len(chunks) and not self._can_chunk(chunks[next_chunk], step):
                next_chunk += 1
            chunk = chunks[next_chunk] if next_chunk < len(chunks) else None
            candidate = self._next_candidate(step)
            if chunk is not None and (
                candidate is None or self._goes_first(chunk, candidate, step)
            ):
                request, level = chunk, chunk.effective_priority
            elif candidate is not None:
                request, level = candidate, self.waiting.effective_priority(candidate, step.now)
            else:
                return
            if step.prefill_level is not None and level > step.prefill_level:
                return
            if request is chunk:
                next_chunk += 1
                num_now = min(_num_left(chunk), step.prefill_tokens_left(chunk.num_computed_tokens))
                self._allocate_or_preempt(chunk, num_now, step)
            else:
                self._consider(request, step)
            scheduled = request.request_id in step.num_scheduled_tokens
            if scheduled and self.policy.ranks and (
                step.prefill_level is None
            ):
                step.prefill_level = level

    def _can_chunk(self, request: Request, step: Step) -> bool:
        """False for a chunk candidate preempted (and maybe readmitted) in this step, or
        whose adapter has no slot in it."""
        return (
            request.status is RequestStatus.RUNNING
            and request.request_id not in step.num_scheduled_tokens
            and request not in step.preempted
            and (self.loras is None or self.loras.runs(request))
        )

    def _goes_first(self, chunk: Request, candidate: Request, step: Step) -> bool:
        """Whether a running request's prefill chunk comes before a waiting request."""
        if self.policy is SchedulingPolicy.FCFS:
            return True
        if self.policy is SchedulingPolicy.SLO:
            key = self._prefill_key(step)
            return key(chunk) <= key(candidate)
        waiting_key = (
            self.waiting.effective_priority(candidate, step.now),
            candidate.arrival_time,
            candidate.request_id,
        )
        return _effective_key(chunk) < waiting_key

    def _has_protected_decodes(self, step: Step) -> bool:
        """Whether the step decodes a request the prefill cap protects: any but the
        background class's (`background_priority`), which carries no latency promise."""
        background = self.config.background_priority
        if background is None:
            return bool(step.decode_ids)
        return any(self.requests[i].priority < background for i in step.decode_ids)

    def _prefill_key(self, step: Step) -> Callable[[Request], tuple[Any, ...]]:
        """The order of prefill work: effective priority, then arrival (slo: slack)."""
        if self.policy is SchedulingPolicy.SLO:
            return lambda request: self.slo.prefill_key(request, step.now)
        return _effective_key

    def _build_output(self, step: Step, loads: list[str], evictions: list[str]
                      ) -> SchedulerOutput:
        finished_ids, self._finished_ids = self._finished_ids, []
        return build_output(step, self.requests, self.kv_cache, finished_ids, loads, evictions)

    def draft_room(self, request: Request, step: Step) -> int:
        """Drafts `request` may verify in `step` within better decodes' tpot (slo)."""
        if self.policy is not SchedulingPolicy.SLO:
            return self.config.max_num_batched_tokens
        work = work_of(step, self.requests)
        return self.slo.draft_room(request, work)

    def observe_step(self, work: StepWork, seconds: float, gap_s: float | None = None) -> None:
        """The engine ran a step of `work` (`last_step_work`) in `seconds`: `SloPlanner`."""
        self.slo.observe(work, seconds, gap_s)

    def _release_held(self, leader: Request) -> None:
        for request in self.sharing.release(leader):
            self.waiting.add(request)

    def _unqueue(self, request: Request) -> None:
        """Take a request that is not running out of whichever waiting queue holds it."""
        if request in self.waiting:
            self.waiting.remove(request)
        elif request in self.skipped_waiting:
            self.skipped_waiting.remove(request)
        elif self.loras is None or not self.loras.unhold(request):
            self.sharing.remove(request)

    def _release(self, request: Request, status: RequestStatus) -> None:
        """Finish `request`: status, blocks freed, forgotten, id queued for the runner; the
        choices held back for it go on without it. The caller takes it out of its queue."""
        request.status = status
        self.kv_cache.free(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)
        self._release_held(request)
        if self.loras is not None:
            self.loras.forget(request)


def _num_left(request: Request) -> int:
    """Tokens of `request` (known or being sampled) whose KV is still to compute."""
    return request.num_tokens + request.num_output_placeholders - request.num_computed_tokens


def _effective_key(request: Request) -> tuple[int, float, str]:
    return (request.effective_priority, request.arrival_time, request.request_id)
