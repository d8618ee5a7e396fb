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
     order under priority); when the KV pool is out of blocks, a victim is preempted
     (`pick_lowest_priority` or `pick_latest_admitted`), possibly the request itself;
  2. prefill work, running chunks and waiting admissions alike, in policy order (under
     fcfs running chunks first, then waiting requests in arrival order; under priority
     one merged order, so that no waiting request is denied budget that a worse-priority
     prefill gets, and within the level of the first prefill, so that worse prefills do
     not lengthen an urgent prompt's step); a step that carries decodes takes at most
     max(`long_prefill_token_threshold`, PREFILL_TOKENS_PER_REQUEST x the batch: the
     unfinished requests, up to the seats) prefill tokens in all (a token at a long
     context counting for more, `prefill_cost`; a prompt being admitted just over what
     is left goes whole, WHOLE_PROMPT_SLACK), so that no prompt, long or many, stalls
     everyone's stream. Under priority, a waiting request that does not fit preempts
     running requests of strictly worse priority (`_admit_by_preempting`). After a
     preemption for a decode's growth the pool is short: only requests more urgent than
     every victim are admitted (none under fcfs).
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

import bisect
import heapq
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcache.block_pool import KVCacheBlock
from kvcache.config import CacheConfig
from kvcache.kv_cache_manager import KVCacheManager, cdiv
from scheduler.config import SchedulerConfig
from scheduler.fair_share import FairShare
from scheduler.output import (
    PLACEHOLDER_TOKEN_ID,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from scheduler.request import Request, RequestStatus
from scheduler.request_queue import PriorityRequestQueue, SchedulingPolicy, create_request_queue

# A step that carries decodes takes at most this many prefill tokens per request of the
# batch (or long_prefill_token_threshold, if more). NOTE: a step costs about a fixed part,
# plus a part per decode, plus a part per prefill token of the same order on a CPU
# (both are rows of the same matmuls); so prefill tokens proportional to the batch bound
# every stream's stall to a fixed factor of its usual step at any batch size. Measured on
# the default model, two AVX-512 cores, 16 decodes beside a 2,000-token prompt
# (bench/prefill_stall.py): the steps with a chunk at a median 2.2-2.4x the decode step
# with 2 per request (threshold 32), 3.2-3.5x with 4 (threshold 64).
PREFILL_TOKENS_PER_REQUEST = 2
# A prompt being admitted whose whole cost is at most this factor of the prefill room left
# goes whole instead of being split. NOTE: a split costs the request a whole extra step
# (its first token waits for the batch's next step) to spare the batch a small tail; so
# a 128-token urgent prompt beside 48 decodes (room 98) goes in one step. Only prompts
# being admitted: a long prompt's chunks stay within the cap.
WHOLE_PROMPT_SLACK = 1.5
# A prefill position at context c counts as 1 + c / ATTENTION_COST_CONTEXT tokens against
# that cap: its attention reads c keys. NOTE: measured on the default model on two CPU
# cores: a 64-token chunk at context 1,900 costs 2.2x per token what a 128-token prompt
# from 0 does.
ATTENTION_COST_CONTEXT = 2048


@dataclass(frozen=True)
class SchedulerStats:
    """Counters and gauges for metrics (token counts for the prefix cache)."""

    num_running: int
    num_waiting: int
    num_preemptions_total: int
    kv_cache_usage: float
    prefix_cache_queries_tokens: int
    prefix_cache_hits_tokens: int
    num_free_blocks: int
    num_cached_blocks: int
    num_blocks: int
    num_waiting_by_priority: dict[int, int] = field(default_factory=dict)
    num_running_by_priority: dict[int, int] = field(default_factory=dict)
    num_preemptions_by_priority: dict[int, int] = field(default_factory=dict)  # cumulative


@dataclass
class _Step:
    """Bookkeeping of one schedule() call."""

    now: float
    budget: int
    # request id -> tokens to compute, in scheduling order
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    # Set once a running request's growth preempted: under priority, only requests more
    # urgent than this are admitted from then on; under fcfs nobody is.
    must_beat: int | None = None
    # The waiting head that could not be admitted (then only preempting admissions go on,
    # leaving it `num_reserved_blocks` free blocks), and whether admission is over.
    parked_head: Request | None = None
    num_reserved_blocks: int = 0
    admission_closed: bool = False
    decode_ids: set[str] = field(default_factory=set)
    # Prefill cost (see `prefill_cost`) the step may still take beside its decodes (None:
    # only the budget bounds prefills); set once the decodes are scheduled.
    prefill_room: int | None = None
    prefill_costs: dict[str, int] = field(default_factory=dict)
    # Under priority: the level of the step's first prefill work; worse levels wait.
    prefill_level: int | None = None

    def schedule(self, request: Request, num_tokens: int, *, decode: bool = False) -> None:
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.budget -= num_tokens
        if decode:
            self.decode_ids.add(request.request_id)
        elif self.prefill_room is not None:
            cost = prefill_cost(request.num_computed_tokens, num_tokens)
            self.prefill_costs[request.request_id] = cost
            self.prefill_room -= cost

    def unschedule(self, request: Request) -> None:
        """A victim scheduled earlier in this step gives its tokens back."""
        num_tokens = self.num_scheduled_tokens.pop(request.request_id, 0)
        self.budget += num_tokens
        self.decode_ids.discard(request.request_id)
        if self.prefill_room is not None:
            self.prefill_room += self.prefill_costs.pop(request.request_id, 0)

    def has_prefill_room(self) -> bool:
        return self.budget > 0 and (self.prefill_room is None or self.prefill_room > 0)

    def prefill_tokens_left(self, start: int) -> int:
        """The most tokens a prefill from position `start` may compute in this step (at
        least 1 while there is room)."""
        if self.prefill_room is None:
            return self.budget
        return min(self.budget, max(1, tokens_within(self.prefill_room, start)))

    def admission_tokens(self, start: int, num_new: int) -> int:
        """The tokens a prompt being admitted computes in this step: all `num_new` from
        position `start` if their cost is within WHOLE_PROMPT_SLACK x the room (and the
        budget), else what `prefill_tokens_left` allows."""
        if (
            self.prefill_room is not None
            and num_new <= self.budget
            and prefill_cost(start, num_new) <= self.prefill_room * WHOLE_PROMPT_SLACK
        ):
            return num_new
        return min(num_new, self.prefill_tokens_left(start))


def prefill_cost(start: int, num_tokens: int) -> int:
    """The cost, against a step's prefill cap, of computing prompt positions [start, start
    + num_tokens): a position at context c costs 1 + c / ATTENTION_COST_CONTEXT tokens."""
    return num_tokens + num_tokens * (2 * start + num_tokens) // (2 * ATTENTION_COST_CONTEXT)


def tokens_within(room: int, start: int) -> int:
    """The most tokens from position `start` whose prefill_cost fits in `room`."""
    k = ATTENTION_COST_CONTEXT
    a = 1 + start / k  # cost(n) ~ a n + n^2 / (2 k): solve for n
    n = int(k * (math.sqrt(a * a + 2 * room / k) - a))
    while n > 0 and prefill_cost(start, n) > room:
        n -= 1
    while prefill_cost(start, n + 1) <= room:
        n += 1
    return n


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


def check_stop(request: Request, max_len: int) -> RequestStatus | None:
    """Finished status of `request` after its latest token, or None to go on.

    EOS (unless ignore_eos) and stop_token_ids stop it, but not before min_tokens
    outputs; max_tokens outputs, or max_len tokens in all, cap its length.
    """
    params = request.sampling_params
    last_token_id = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and last_token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if last_token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None


class Scheduler:
    """FCFS or priority continuous batching over a paged KV cache, with preemption.

    `running` is in admission order under fcfs and in priority order under priority.
    `clock` (seconds, time.monotonic by default) times waits for aging; tests inject one.

    Aging (priority_aging_s) orders the waiting queue by effective priority, so a long
    waiter gets ahead of newer, more urgent requests, down to priority_aging_floor or its
    tenant's bound at most. It grants no power to preempt nor shields from it: only a
    strictly better base priority preempts, and victims go by base priority. A request
    keeps the effective priority it was admitted with for the order of its prefill chunks.

    A request with a deadline still unfinished when it passes is finished with
    FINISHED_DEADLINE at the next schedule(), before anything is computed for it (and
    returned by the following update() with the requests that got tokens).

    The choices of an n > 1 request compute the prompt once: a request naming a
    `prompt_leader_id` is held back until the leader has computed every full block of the
    prompt, then shares those blocks (through the prefix cache, or directly from the
    leader when caching is off).
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
        self.waiting = create_request_queue(
            self.policy, scheduler_config.priority_aging_s,
            scheduler_config.priority_aging_floor, clock,
        )
        self.skipped_waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        # n > 1: prompt leader id -> the choices held back until it computed the prompt
        self.held: dict[str, list[Request]] = {}
        self.num_preemptions_total = 0
        self._num_preemptions_by_priority: Counter[int] = Counter()
        self._finished_ids: list[str] = []
        self.fair_share = (
            FairShare()
            if scheduler_config.fair_share and self.policy is SchedulingPolicy.PRIORITY
            else None
        )
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
        """Queue a new request.

        ValueError (and nothing queued) if its id is already in flight, its prompt is
        empty, or its prompt has max_request_len tokens or more (max_model_len, or the
        KV pool less the watermark, whichever is smaller): such a prompt could never
        produce a token, and left in the queue it would block every request behind it.
        A request whose prompt leader is in flight and has not computed the prompt yet
        is held back until it has.
        """
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
        if self.fair_share is not None:
            self.fair_share.tag(request)
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, request.request_id))
            if len(self._deadlines) > 2 * len(self.requests) + 1024:  # finished ones linger
                self._deadlines = [d for d in self._deadlines if d[1] in self.requests]
                heapq.heapify(self._deadlines)
        leader = self.requests.get(request.prompt_leader_id or "")
        if leader is not None and not self._has_computed_prompt(leader):
            self.held.setdefault(leader.request_id, []).append(request)
        else:
            if leader is not None:
                _share_prompt_logprobs(leader, request)
            self.waiting.add(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Abort running or waiting requests (FINISHED_ABORTED, blocks freed).

        Unknown or already finished ids are ignored. Returns the requests aborted.
        """
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(
        self, request_ids: Iterable[str] | str, status: RequestStatus
    ) -> list[Request]:
        """Finish requests from outside with a FINISHED_* `status` (e.g. FINISHED_STOPPED
        when the server matched a stop string). Unknown ids are ignored; blocks are freed
        and the ids reach the runner in the next schedule()'s finished_ids. O(1) per
        waiting request, O(running) once for running ones."""
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
        step = _Step(now=self._clock(), budget=self.config.max_num_batched_tokens)
        self._expire_deadlines(step.now)
        self._schedule_decodes(step)
        step.prefill_room = self._prefill_cap(bool(step.decode_ids))
        self._schedule_prefills(step)
        parked = [self.skipped_waiting.pop() for _ in range(len(self.skipped_waiting))]
        self.waiting.prepend_requests(parked)
        return self._build_output(step)

    def update(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Apply a computed step: append the sampled tokens, stop, key full blocks.

        Returns the requests whose deadline passed in schedule(), then those that got a
        token this step (finished ones included), in batch order. Requests finished or
        aborted since schedule() are skipped; one preempted since gets its token (it was
        sampled from the right context). ValueError if the runner returned no token for a
        request that sampled.
        """
        outputs, self._expired = self._expired, []
        any_finished = False
        for scheduled in scheduler_output.scheduled:
            request = self.requests.get(scheduled.request_id)
            if request is None:
                continue
            running = request.status is RequestStatus.RUNNING
            prompt_logprobs = runner_output.prompt_logprobs.get(request.request_id)
            if prompt_logprobs is not None and request.prompt_logprobs is not None:
                request.prompt_logprobs.extend(prompt_logprobs)
            if scheduled.sample:
                token_id = runner_output.sampled_token_ids.get(request.request_id)
                if token_id is None:
                    raise ValueError(f"the runner sampled no token for {request.request_id}")
                request.num_output_placeholders -= 1
                request.append_output_token(
                    token_id, runner_output.logprobs.get(request.request_id)
                )
            if running:
                # NOTE: blocks whose KV a later scheduled step computes may be keyed now:
                # every step that could read them runs after that one.
                num_known = min(request.num_computed_tokens, request.num_tokens)
                self.kv_cache.cache_blocks(request, num_known)
                if request.request_id in self.held and self._has_computed_prompt(request):
                    self._release_held(request)
            if not scheduled.sample:
                continue
            status = check_stop(request, self.max_request_len)
            if status is not None:
                if not running:
                    self._unqueue(request)
                self._release(request, status)
                any_finished = running or any_finished
            outputs.append(request)
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    def _expire_deadlines(self, now: float) -> None:
        """Finish every unfinished request whose deadline is past; O(expired log n)."""
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

    def has_finished_requests(self) -> bool:
        """True when finished ids wait to be handed to the runner by the next schedule()."""
        return bool(self._finished_ids)

    @property
    def num_running(self) -> int:
        """Requests holding a seat (and blocks)."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission, preempted and held-back ones included."""
        return len(self.requests) - len(self.running)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self.requests.get(request_id)

    @property
    def stats(self) -> SchedulerStats:
        """Counters and gauges for metrics; O(running + held), not O(waiting)."""
        kv = self.kv_cache
        # NOTE: outside schedule() skipped_waiting is empty: waiting and held are all.
        waiting_by_priority = Counter(self.waiting.count_by_priority())
        waiting_by_priority.update(r.priority for held in self.held.values() for r in held)
        return SchedulerStats(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            num_preemptions_total=self.num_preemptions_total,
            kv_cache_usage=kv.usage,
            prefix_cache_queries_tokens=kv.prefix_cache_queries_tokens,
            prefix_cache_hits_tokens=kv.prefix_cache_hits_tokens,
            num_free_blocks=kv.num_free_blocks,
            num_cached_blocks=kv.num_cached_blocks,
            num_blocks=kv.num_blocks,
            num_waiting_by_priority=dict(waiting_by_priority),
            num_running_by_priority=dict(Counter(r.priority for r in self.running)),
            num_preemptions_by_priority=dict(self._num_preemptions_by_priority),
        )

    def snapshot(self, max_waiting: int = 100) -> dict[str, Any]:
        """JSON-ready view for GET /scheduler/state: policy, running requests, the first
        `max_waiting` waiting requests in policy order (`num_waiting` counts them all) and
        the KV pool. O(running + W log max_waiting)."""
        kv = self.kv_cache
        return {
            "policy": self.policy.value,
            "running": [self._describe(r) for r in self.running],
            "waiting": [self._describe(r) for r in self.waiting.head(max_waiting)],
            "num_waiting": self.num_waiting,
            "kv_cache": {
                "num_blocks": kv.num_blocks,
                "num_free_blocks": kv.num_free_blocks,
                "num_cached_blocks": kv.num_cached_blocks,
                "block_size": kv.block_size,
                "usage": kv.usage,
            },
            "num_preemptions_total": self.num_preemptions_total,
        }

    def check_integrity(self) -> None:
        """RuntimeError unless the KV pool is consistent, every request is in exactly one
        queue with a matching status, and only running requests hold blocks. O(blocks +
        requests): run it when idle or when asked, not every step."""
        self.kv_cache.check_integrity()
        running_ids = [r.request_id for r in self.running]
        held = [r for siblings in self.held.values() for r in siblings]
        waiting = [*self.waiting, *self.skipped_waiting, *held]
        all_ids = running_ids + [r.request_id for r in waiting]
        if len(set(all_ids)) != len(all_ids):
            raise RuntimeError("a request is queued twice")
        if set(all_ids) != set(self.requests):
            raise RuntimeError(
                f"queues and request table disagree: {sorted(set(all_ids) ^ set(self.requests))}"
            )
        if len(self.running) > self.config.max_num_seqs:
            raise RuntimeError(f"{len(self.running)} running > max_num_seqs")
        for request in self.running:
            if request.status is not RequestStatus.RUNNING:
                raise RuntimeError(f"{request!r} is in running")
            num_held = self.kv_cache.num_held_blocks(request.request_id)
            if num_held * self.kv_cache.block_size < request.num_computed_tokens:
                raise RuntimeError(f"{request!r} holds {num_held} blocks: too few")
        for request in waiting:
            if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                raise RuntimeError(f"{request!r} is in waiting")
            if request.num_computed_tokens:
                raise RuntimeError(f"waiting {request!r} has computed tokens")
        for leader_id in self.held:
            if leader_id not in self.requests:
                raise RuntimeError(f"requests held back for {leader_id}, which is gone")
        holders = self.kv_cache.holders()
        if not holders <= set(running_ids):
            raise RuntimeError(f"requests not running hold blocks: {holders - set(running_ids)}")

    # ---- scheduling internals ----

    def _schedule_decodes(self, step: _Step) -> None:
        """One token for every running request that has one left, in `running` order."""
        for request in list(self.running):
            if step.budget == 0:
                return
            if request.status is not RequestStatus.RUNNING or _num_left(request) != 1:
                continue
            if request.num_output_placeholders and self._pending_token_ends(request):
                continue
            self._allocate_or_preempt(request, 1, step, decode=True)

    def _pending_token_ends(self, request: Request) -> bool:
        """Whether the token `request` is being sampled reaches max_tokens or the length
        cap (then it finishes with that token, whatever it is)."""
        num_outputs = request.num_output_tokens + request.num_output_placeholders
        return (num_outputs >= request.sampling_params.max_tokens
                or request.num_tokens + request.num_output_placeholders >= self.max_request_len)

    def _schedule_prefills(self, step: _Step) -> None:
        """Running chunks and waiting admissions in one policy order, while budget lasts.

        Under priority, a step's prefill work stays within one priority level, the first
        one that gets any. NOTE: a step ends when all its work ends, so worse-priority
        prefill tokens in the step of an urgent prompt would delay that prompt's first
        token (measured with bench.priority_sim: TTFT at idle + 2.7 loaded steps with
        them, + 0.8 without); they wait for the next step instead.
        """
        chunks = [r for r in self.running if _num_left(r) > 1]
        if self.policy is SchedulingPolicy.PRIORITY:
            chunks.sort(key=_effective_key)
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
            if scheduled and self.policy is SchedulingPolicy.PRIORITY and (
                step.prefill_level is None
            ):
                step.prefill_level = level

    @staticmethod
    def _can_chunk(request: Request, step: _Step) -> bool:
        """False for a chunk candidate preempted (and maybe readmitted) in this step."""
        return (
            request.status is RequestStatus.RUNNING
            and request.request_id not in step.num_scheduled_tokens
            and request not in step.preempted
        )

    def _goes_first(self, chunk: Request, candidate: Request, step: _Step) -> bool:
        """Whether a running request's prefill chunk comes before a waiting request."""
        if self.policy is SchedulingPolicy.FCFS:
            return True
        waiting_key = (
            self.waiting.effective_priority(candidate, step.now),
            candidate.arrival_time,
            candidate.request_id,
        )
        return _effective_key(chunk) < waiting_key

    def _prefill_cap(self, has_decodes: bool) -> int | None:
        """The most prefill tokens, in all, a step (that `has_decodes`) carries:
        max(long_prefill_token_threshold, PREFILL_TOKENS_PER_REQUEST x the batch about to
        decode); None (only the budget) for a step without decodes (a lone prefill delays
        nobody) or with the threshold off.

        NOTE: the batch about to decode is every unfinished request, up to the seats, not
        just this step's decodes: in a burst the first few streams' steps soon grow to
        the whole batch's, so admission runs at the rate the full batch allows instead of
        starting from the few decodes that exist at first.
        """
        threshold = self.config.long_prefill_token_threshold
        if not threshold or not has_decodes:
            return None
        num_batch = min(len(self.requests), self.config.max_num_seqs)
        return max(threshold, PREFILL_TOKENS_PER_REQUEST * num_batch)

    def _next_candidate(self, step: _Step) -> Request | None:
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
            assert isinstance(self.waiting, PriorityRequestQueue)
            candidate = self.waiting.peek_most_urgent()
            worst_running = max((r.priority for r in self.running), default=None)
            if worst_running is None or candidate.priority >= worst_running:
                return None
        if candidate in step.preempted:
            return None  # it gave its blocks up in this step: no coming straight back
        return candidate

    def _consider(self, request: Request, step: _Step) -> None:
        """Try to admit a waiting request; park it (and narrow admission) when it fails."""
        self.waiting.remove(request)
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
        self, request: Request, num_new_tokens: int, step: _Step, *, decode: bool = False
    ) -> None:
        """Schedule a running request, preempting victims until its blocks fit (the victim
        may be the request itself: then it is preempted and not scheduled). The pool is
        then short: admission narrows to requests more urgent than every victim."""
        while self.kv_cache.allocate_slots(request, num_new_tokens) is None:
            victim = self._pick_victim()
            self._preempt(victim, step)
            if self.policy is SchedulingPolicy.FCFS:
                step.admission_closed = True
            elif step.must_beat is None or victim.priority < step.must_beat:
                step.must_beat = victim.priority
            if victim is request:
                return
        step.schedule(request, num_new_tokens, decode=decode)

    def _pick_victim(self) -> Request:
        if self.policy is SchedulingPolicy.PRIORITY:
            return pick_lowest_priority(self.running)
        return pick_latest_admitted(self.running)

    def _preempt(self, request: Request, step: _Step) -> None:
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

    def _admit(self, request: Request, step: _Step) -> bool:
        if len(self.running) < self.config.max_num_seqs and self._try_admit(request, step):
            return True
        return self.policy is SchedulingPolicy.PRIORITY and self._admit_by_preempting(
            request, step
        )

    def _try_admit(self, request: Request, step: _Step) -> bool:
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
        if self.policy is SchedulingPolicy.PRIORITY:
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
        block_size = self.kv_cache.block_size
        num_shared = min(
            leader.num_computed_tokens,
            request.num_prompt_tokens,
            request.num_tokens - 1,
        ) // block_size
        shared = self.kv_cache.get_leading_blocks(leader.request_id, num_shared)
        return shared, len(shared) * block_size

    def _admit_by_preempting(self, request: Request, step: _Step) -> bool:
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
            victim = pick_lowest_priority(candidates)
            candidates.remove(victim)
            self._preempt(victim, step)
            if len(self.running) < self.config.max_num_seqs and self._try_admit(request, step):
                return True
        return False

    def _build_output(self, step: _Step) -> SchedulerOutput:
        scheduled = []
        for request_id, num_new in step.num_scheduled_tokens.items():
            request = self.requests[request_id]
            start = request.num_computed_tokens
            end = start + num_new
            token_ids = request.all_token_ids[start:end]
            if end > request.num_tokens:  # the token of an unfinished step: a placeholder
                token_ids += [PLACEHOLDER_TOKEN_ID] * (end - request.num_tokens)
            sample = end == request.num_tokens + request.num_output_placeholders
            scheduled.append(
                ScheduledRequest(
                    request_id=request_id,
                    token_ids=token_ids,
                    num_computed_tokens=start,
                    block_table=self.kv_cache.get_block_ids(request_id),
                    sample=sample,
                    sampling_params=request.sampling_params,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=request.output_token_ids,
                    prompt_logprob_rows=_prompt_logprob_rows(request, start, end),
                )
            )
            request.num_computed_tokens = end
            if sample:
                request.num_output_placeholders += 1
        finished_ids, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            scheduled=scheduled,
            preempted_ids=[r.request_id for r in step.preempted],
            finished_ids=finished_ids,
        )

    def _has_computed_prompt(self, leader: Request) -> bool:
        """Whether `leader` has computed every full prompt block a choice could share (and
        its prompt logprobs, which the choices then share too)."""
        block_size = self.kv_cache.block_size
        shareable = (leader.num_prompt_tokens - 1) // block_size * block_size
        return leader.num_computed_tokens >= shareable and not leader.needs_prompt_logprobs

    def _release_held(self, leader: Request) -> None:
        for request in self.held.pop(leader.request_id, ()):
            _share_prompt_logprobs(leader, request)
            self.waiting.add(request)

    def _unqueue(self, request: Request) -> None:
        """Take a request that is not running out of whichever waiting queue holds it."""
        if request in self.waiting:
            self.waiting.remove(request)
        elif request in self.skipped_waiting:
            self.skipped_waiting.remove(request)
        else:
            siblings = self.held.get(request.prompt_leader_id or "", [])
            if request in siblings:
                siblings.remove(request)
                if not siblings:
                    del self.held[request.prompt_leader_id or ""]

    def _release(self, request: Request, status: RequestStatus) -> None:
        """Finish `request`: status, blocks freed, forgotten, id queued for the runner; the
        choices held back for it go on without it. The caller takes it out of its queue."""
        request.status = status
        self.kv_cache.free(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)
        if request.request_id in self.held:
            self._release_held(request)

    def _describe(self, request: Request) -> dict[str, Any]:
        return {
            "request_id": request.request_id,
            "status": request.status.name,
            "tenant": request.tenant,
            "priority": request.priority,
            "effective_priority": (
                request.effective_priority
                if request.status is RequestStatus.RUNNING
                else self.waiting.effective_priority(request, self._clock())
            ),
            "arrival_time": request.arrival_time,
            "num_prompt_tokens": request.num_prompt_tokens,
            "num_output_tokens": request.num_output_tokens,
            "num_computed_tokens": request.num_computed_tokens,
            "num_blocks": self.kv_cache.num_held_blocks(request.request_id),
            "num_preemptions": request.num_preemptions,
        }


def _num_left(request: Request) -> int:
    """Tokens of `request` (known or being sampled) whose KV is still to compute."""
    return request.num_tokens + request.num_output_placeholders - request.num_computed_tokens


def _effective_key(request: Request) -> tuple[int, float, str]:
    return (request.effective_priority, request.arrival_time, request.request_id)


def _prompt_logprob_rows(request: Request, start: int, end: int) -> tuple[int, int]:
    """Offsets into the chunk of positions [start, end) whose logits give the prompt
    logprobs `request` still misses (position p's give prompt token p + 1's)."""
    logprobs = request.prompt_logprobs
    if logprobs is None or logprobs.end >= request.num_prompt_tokens:
        return (0, 0)
    lo, hi = max(start, logprobs.end - 1), min(end, request.num_prompt_tokens - 1)
    return (lo - start, hi - start) if lo < hi else (0, 0)


def _share_prompt_logprobs(leader: Request, request: Request) -> None:
    """n > 1: a choice takes its prompt leader's prompt logprobs once they are complete
    (else it computes its own)."""
    if request.prompt_logprobs is not None and leader.prompt_logprobs is not None and (
        not leader.needs_prompt_logprobs
    ):
        request.prompt_logprobs = leader.prompt_logprobs
        request.shares_prompt_logprobs = True
