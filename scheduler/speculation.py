"""Speculative decoding's share of the scheduler: n-gram proposals, who verifies them (by
priority), and what a verified step leaves.

A running request that decodes may propose draft tokens (`propose_ngram`: what followed
the most recent earlier occurrence of its last n tokens); the step then computes its last
token and the drafts as one chunk, and the runner accepts a prefix of the drafts plus one
token of its own (model_runner/spec_decode.py). Each step's drafts are granted after the
decodes, in `running` order (priority order under priority), within three bounds:

  - the step's token budget, and `max_num_verify_tokens` for the decodes and drafts
    together: so as the batch grows speculation stops, the least urgent first;
  - never before the prefill work of a strictly more urgent request: the decodes at
    least as urgent as the best prefill work in sight (a running chunk or the waiting
    head, by effective priority) get theirs before prefills, the others from what the
    prefills leave (under fcfs every priority is 0: all before);
  - blocks: the drafts' slots are allocated if the pool has them (never by preempting);
  - under slo, the TPOT targets of better priorities: a decode's drafts only while the
    predicted step stays within the tightest tpot_s among the decodes more urgent than
    it (scheduler/slo.py), so low-priority drafts never stretch an urgent stream.

Who speculates (`limit`, once per request): the server's num_speculative_tokens, capped
by the request's own (0: never). Requests with penalties never speculate (their
penalties count the tokens before each position on the device, which drafts are not
yet), nor do requests still short of min_tokens (whose stop tokens are masked per
position). A request with a grammar speculates through `check_drafts` (the engine's
structured outputs): its drafts are cut before the first token its grammar rejects (or
one that ends it), before any slot is allocated for them, and the runner masks each
verified position with the grammar's state after the drafts before it
(structured/matchers.py); without a check it gets no drafts.
A draft never reaches past max_tokens or the length cap: the request's tokens after a
verified step are at most what it may still produce.

With a draft model (`"method": "draft_model"`) the drafts are the model runner's proposal
after the request's previous step (model_runner/draft_model.py): a request granted room
for drafts also gets that many lookahead slots allocated (free blocks only; fewer, down to
what its blocks hold, when the pool is short) and the runner proposes as many tokens to
follow its newest one; the next step's grant takes them, truncated to its room. Who gets
drafts and how many is the n-gram rule's; only their source differs.

Rejected drafts roll back: `num_computed_tokens` counts the accepted tokens only, and
the blocks stay with the request (their slots are written again by its next tokens; its
table only grows), so only blocks full of accepted tokens are keyed in the prefix cache.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvcache.kv_cache_manager import KVCacheManager
from scheduler.admission import Step
from scheduler.config import SpeculativeConfig
from scheduler.output import (
    ModelRunnerOutput,
    SampleLogprobs,
    ScheduledRequest,
    SchedulerOutput,
)
from scheduler.request import Request, RequestStatus, check_stop
from scheduler.request_queue import RequestQueue, SchedulingPolicy
from scheduler.sampling_params import SamplingParams


def propose_ngram(
    token_ids: Sequence[int], num_tokens: int, lookup_max: int, lookup_min: int, window: int
) -> list[int]:
    """Up to `num_tokens` tokens that followed the most recent earlier occurrence of the
    last n of `token_ids` (n from lookup_max down to lookup_min), searched within the last
    `window` tokens; [] without a match. O(window) at C speed, plus a slice per candidate."""
    context = list(token_ids[-window:])
    context.reverse()  # NOTE: the most recent occurrence is then the first found
    size = len(context)
    for n in range(min(lookup_max, size - 1), lookup_min - 1, -1):
        pattern = context[:n]
        first = pattern[0]
        at = 0
        while True:
            try:
                at = context.index(first, at + 1, size - n + 1)
            except ValueError:
                break
            if context[at:at + n] == pattern:
                # context[at - 1] down to context[0] followed it, most recent last
                follow = context[max(0, at - num_tokens):at]
                follow.reverse()
                return follow
    return []


@dataclass(frozen=True)
class SpecDecodeStats:
    """Cumulative counters of speculation: verifications (`num_drafts`), draft tokens
    proposed and accepted, accepted by position (index 0: the first draft), and proposed
    and accepted by the request's priority."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()
    draft_tokens_by_priority: dict[int, int] = field(default_factory=dict)
    accepted_tokens_by_priority: dict[int, int] = field(default_factory=dict)


# (request id, its proposed tokens) -> how many of them its grammar lets it verify
DraftCheck = Callable[[str, list[int]], int]


class _Scheduler(Protocol):
    """What speculation reads of the Scheduler."""

    policy: SchedulingPolicy
    kv_cache: KVCacheManager
    waiting: RequestQueue
    running: list[Request]
    max_request_len: int

    def draft_room(self, request: Request, step: Step) -> int:
        """The drafts `request` may add within the latency targets of better ones."""


class Speculation:
    """The scheduler's speculation: per-request limits, each step's grants, the counters."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._later: list[Request] = []  # this step's decodes granted after the prefills
        self._room = 0  # draft tokens this step may still verify
        self._num_drafts = 0
        self._accepted_per_position = [0] * config.num_speculative_tokens
        self._draft_tokens: Counter[int] = Counter()  # by priority
        self._accepted_tokens: Counter[int] = Counter()
        self.check_drafts: DraftCheck | None = None  # the grammars' (set by the engine)

    def any_speculates(self, plan: SchedulerOutput, requests: dict[str, Request]) -> bool:
        """Whether a request that samples in `plan` speculates: with overlapped steps its
        tokens must be on the host before the next step is scheduled (its drafts follow
        its last token)."""
        for scheduled in plan.scheduled:
            request = requests.get(scheduled.request_id) if scheduled.sample else None
            if request is not None and request.num_speculative_tokens:
                return True
        return False

    def limit(self, params: SamplingParams) -> int:
        """The most draft tokens a request of `params` verifies in a step (0: none)."""
        if params.has_penalties:
            return 0
        own = params.num_speculative_tokens
        k = self.config.num_speculative_tokens
        return k if own is None else min(own, k)

    def grant_before_prefills(self, scheduler: _Scheduler, step: Step) -> None:
        """Drafts for this step's decodes at least as urgent as the best prefill work in
        sight; the others wait for `grant_after_prefills`."""
        self._room = self.config.max_num_verify_tokens - len(step.decode_ids)
        self._later = []
        bound = _best_prefill_priority(scheduler, step.now)
        for request in scheduler.running:
            if request.num_speculative_tokens and request.request_id in step.decode_ids:
                if bound is None or request.effective_priority <= bound:
                    self._grant(request, scheduler, step)
                else:
                    self._later.append(request)

    def grant_after_prefills(self, scheduler: _Scheduler, step: Step) -> None:
        """Drafts for the decodes left, from what the prefills left of the budget."""
        later, self._later = self._later, []
        for request in later:
            if request.request_id in step.decode_ids:  # not preempted since
                self._grant(request, scheduler, step)

    def _grant(self, request: Request, scheduler: _Scheduler, step: Step) -> None:
        params = request.sampling_params
        num_room = min(
            self._room,
            step.budget,
            request.num_speculative_tokens,
            params.max_tokens - request.num_output_tokens - 1,
            scheduler.max_request_len - request.num_tokens - 1,
            scheduler.draft_room(request, step),
        )
        if (num_room <= 0 or request.num_output_placeholders
                or request.num_output_tokens < params.min_tokens):
            return
        drafts = self._propose(request, num_room)
        if drafts and params.grammar is not None:
            drafts = self._grammar_cut(request, drafts)
        num_lookahead = 0
        if self.config.model is not None:
            # NOTE: what this step has room for, proposed for the next, whose last draft
            # decode stays within the length cap
            num_lookahead = min(num_room,
                                scheduler.max_request_len - request.num_tokens - len(drafts))
        if not drafts and not num_lookahead:
            return
        drafts, num_lookahead = _allocate(request, scheduler.kv_cache, drafts, num_lookahead)
        if drafts:
            step.add_drafts(request, drafts)
            self._room -= len(drafts)
        if num_lookahead:
            step.num_lookahead_tokens[request.request_id] = num_lookahead

    def _propose(self, request: Request, num_room: int) -> list[int]:
        """Up to `num_room` draft tokens: n-gram lookup, or the draft model's latest
        proposal while it still follows the request's tokens."""
        config = self.config
        if config.model is None:
            return propose_ngram(request.all_token_ids, num_room, config.prompt_lookup_max,
                                 config.prompt_lookup_min, config.prompt_lookup_window)
        if request.proposal_at != request.num_tokens:
            return []
        return list(request.proposal[:num_room])

    def keep_proposals(self, runner_output: ModelRunnerOutput,
                       requests: dict[str, Request]) -> None:
        """Keep the draft model's proposals of a step, once its tokens are appended: the
        next step's grants verify them."""
        for request_id, token_ids in runner_output.draft_token_ids.items():
            request = requests.get(request_id)
            if request is not None:
                request.proposal, request.proposal_at = token_ids, request.num_tokens

    def _grammar_cut(self, request: Request, drafts: list[int]) -> list[int]:
        """The drafts a constrained request verifies: those its grammar accepts."""
        if self.check_drafts is None:
            return []
        return drafts[:self.check_drafts(request.request_id, drafts)]

    def apply(
        self, request: Request, scheduled: ScheduledRequest, runner_output: ModelRunnerOutput,
        max_len: int,
    ) -> RequestStatus | None:
        """Append what a verification gave `request` (accepted drafts, then the runner's
        own token), token by token up to a stop; roll its progress back to the accepted
        tokens. Returns its finished status, or None. ValueError if the runner gave none."""
        request_id = request.request_id
        token_ids = runner_output.verified_token_ids.get(request_id)
        logprobs: Sequence[SampleLogprobs | None]
        if token_ids is None:  # a runner that does not verify: no draft accepted
            sampled = runner_output.sampled_token_ids.get(request_id)
            if sampled is None:
                raise ValueError(f"the runner sampled no token for {request_id}")
            token_ids, logprobs = [sampled], [runner_output.logprobs.get(request_id)]
        else:
            logprobs = runner_output.verified_logprobs.get(request_id) or [None] * len(token_ids)
        num_drafts = scheduled.num_draft_tokens
        num_accepted = len(token_ids) - 1
        if not 0 <= num_accepted <= num_drafts:
            raise ValueError(f"{len(token_ids)} tokens verified for {request_id}'s "
                             f"{num_drafts} drafts")
        self._count(request.priority, num_drafts, num_accepted)
        request.num_output_placeholders -= 1
        if request.status is RequestStatus.RUNNING:
            request.num_computed_tokens -= num_drafts - num_accepted
        for token_id, token_logprobs in zip(token_ids, logprobs, strict=True):
            request.append_output_token(token_id, token_logprobs)
            status = check_stop(request, max_len)
            if status is not None:
                return status
        return None

    def _count(self, priority: int, num_drafts: int, num_accepted: int) -> None:
        self._num_drafts += 1
        self._draft_tokens[priority] += num_drafts
        self._accepted_tokens[priority] += num_accepted
        for position in range(num_accepted):
            self._accepted_per_position[position] += 1

    @property
    def stats(self) -> SpecDecodeStats:
        """The counters so far."""
        return SpecDecodeStats(
            num_drafts=self._num_drafts,
            num_draft_tokens=self._draft_tokens.total(),
            num_accepted_tokens=self._accepted_tokens.total(),
            accepted_per_position=tuple(self._accepted_per_position),
            draft_tokens_by_priority=dict(self._draft_tokens),
            accepted_tokens_by_priority=dict(self._accepted_tokens),
        )


def _allocate(
    request: Request, kv_cache: KVCacheManager, drafts: list[int], num_lookahead: int
) -> tuple[list[int], int]:
    """The drafts and lookahead slots (draft model) `request` gets blocks for, from free
    blocks only: all of them; else the drafts, and the lookahead slots its blocks hold
    anyway; else no drafts."""
    num_new = 1 + len(drafts)
    if kv_cache.allocate_slots(request, num_new, num_lookahead_tokens=num_lookahead) is not None:
        return drafts, num_lookahead
    if not num_lookahead:
        return [], 0
    if kv_cache.allocate_slots(request, num_new) is None:
        drafts, num_new = [], 1
    num_held = kv_cache.num_held_blocks(request.request_id) * kv_cache.block_size
    return drafts, max(0, min(num_lookahead, num_held - request.num_computed_tokens - num_new))


def _best_prefill_priority(scheduler: _Scheduler, now: float) -> int | None:
    """The most urgent effective priority of prefill work in sight (running chunks and the
    waiting head); None under fcfs (all one level) or with none."""
    if scheduler.policy is SchedulingPolicy.FCFS:
        return None
    chunks = (r.effective_priority for r in scheduler.running
              if r.num_tokens + r.num_output_placeholders - r.num_computed_tokens > 1)
    best = min(chunks, default=None)
    if scheduler.waiting:
        head = scheduler.waiting.peek()
        level = scheduler.waiting.effective_priority(head, now)
        best = level if best is None else min(best, level)
    return best
