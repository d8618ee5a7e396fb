"""A generation request as the scheduler tracks it."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence

from kvcache.hashing import BlockHash
from scheduler.output import PromptLogprobs, SampleLogprobs
from scheduler.placement import Placement
from scheduler.sampling_params import SamplingParams

_NO_PLACEMENT = Placement()  # the default tenant at priority 0


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; every finished state sorts after PREEMPTED."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_DEADLINE = 6
    FINISHED_REJECTED = 7  # its first token could no longer be on time (on_miss: reject)

    @property
    def is_finished(self) -> bool:
        """True for the FINISHED_* states."""
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI finish_reason: "stop", "length", "abort", "deadline", "rejected", or
        None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_DEADLINE: "deadline",
    RequestStatus.FINISHED_REJECTED: "rejected",
}


class Request:
    """Prompt, generated tokens and scheduling state of one sequence.

    `num_computed_tokens` is the one progress counter: tokens whose KV is in the cache or
    being computed by a scheduled step (it advances when a step is scheduled). Prefill,
    chunked prefill, decode and recompute after preemption all follow from comparing it
    with `num_tokens` plus `num_output_placeholders`. `arrival_time` is on the
    time.monotonic() clock.

    Who it is and how it wants to be scheduled (priority, tenant and weight, priority
    bound, deadline, cache salt) is its `placement` (scheduler/placement.py), held whole;
    `priority` and `cache_salt` read it for the KV cache manager (`KVCacheRequest`).
    """

    # The most draft tokens it verifies in a step (speculative decoding; 0: none), set by
    # the scheduler when it takes the request.
    num_speculative_tokens: int = 0
    # Draft-model speculation: the draft tokens the runner proposed to follow the request's
    # first `proposal_at` tokens (the next step verifies them while that is still its
    # length; they are replaced, never mutated).
    proposal: Sequence[int] = ()
    proposal_at: int = 0

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        placement: Placement = _NO_PLACEMENT,
        arrival_time: float | None = None,
        prompt_leader_id: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.placement = placement
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[SampleLogprobs] = []
        # The prompt logprobs gathered so far, chunk by chunk (None: not asked for).
        self.prompt_logprobs = (
            PromptLogprobs(1) if sampling_params.prompt_logprobs is not None else None
        )
        # Its prompt logprobs are its prompt leader's, complete (n > 1), whose first output
        # token came with them: they need not be reported again.
        self.shares_prompt_logprobs = False
        self.num_computed_tokens = 0
        # Tokens being sampled by a step that is scheduled but not yet updated (0 or 1):
        # with overlapped steps the next step is scheduled before they are known.
        self.num_output_placeholders = 0
        self.num_preemptions = 0
        # Prompt tokens found in the prefix cache (or shared with the prompt leader) when
        # the request was first admitted: OpenAI's usage.prompt_tokens_details.cached_tokens.
        self.num_cached_tokens = 0
        # n > 1: another choice of the prompt, which computes it first (scheduler/prompt_sharing.py)
        self.prompt_leader_id = prompt_leader_id
        # Order within its priority level, set once by the fair share (None: by arrival).
        self.fair_tag: float | None = None
        # Prefix-cache keys of the full blocks of all_token_ids (kvcache appends to it).
        self.block_hashes: list[BlockHash] = []
        # Priority after aging (lowered while waiting, kept as admitted while running).
        self.effective_priority = placement.priority
        # Seconds spent waiting before the current wait, and when the current wait began.
        self.waited_s = 0.0
        self.waiting_since = self.arrival_time
        # When its first output token was sampled (the scheduler's clock; None: not yet).
        self.first_token_time: float | None = None
        self._all_token_ids = list(prompt_token_ids)

    @property
    def priority(self) -> int:
        """Its placement's priority: lower is more urgent."""
        return self.placement.priority

    @property
    def cache_salt(self) -> str | None:
        """Its placement's prefix-cache salt, and its LoRA adapter's: two adapters never
        share KV. NOTE: the adapter's part first (admission's salts start with the
        tenant's, from the tenants file, so no request's own salt reproduces it)."""
        lora = self.placement.lora_name
        if lora is None:
            return self.placement.cache_salt
        return f"lora\x01{lora}\x01{self.placement.cache_salt or ''}"

    @property
    def lora_name(self) -> str | None:
        """Its placement's LoRA adapter (None: the base model)."""
        return self.placement.lora_name

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then outputs (the request's own list: read, do not mutate)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens in the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.output_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """True while prompt logprobs were asked for and some are still missing."""
        logprobs = self.prompt_logprobs
        return logprobs is not None and logprobs.end < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        """True once stopped, length-capped or aborted."""
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """"stop", "length", "abort", "deadline", "rejected", or None while unfinished."""
        return self.status.finish_reason

    def append_output_token(self, token_id: int, logprobs: SampleLogprobs | None = None) -> None:
        """Record one sampled token (and its logprobs when the runner returned them)."""
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def start_waiting(self, now: float) -> None:
        """Mark the start of a wait (on preemption)."""
        self.waiting_since = now

    def stop_waiting(self, now: float) -> None:
        """Mark the end of a wait (on admission), adding it to `waited_s`."""
        self.waited_s += now - self.waiting_since

    def time_waited(self, now: float) -> float:
        """Total seconds spent in the waiting queue up to `now`, over every wait."""
        if self.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            return self.waited_s + (now - self.waiting_since)
        return self.waited_s

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"priority={self.priority}, computed={self.num_computed_tokens}/{self.num_tokens})"
        )


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
