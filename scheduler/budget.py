"""One step's token budget, and the cost model of the prefill work beside its decodes.

A step spends at most `max_num_batched_tokens` tokens. A step that carries decodes takes
at most `prefill_cap` of prefill cost beside them, where a prompt position at context c
costs 1 + c / attention_cost_context tokens (its attention reads c keys): so that no
prompt, long or many, stalls everyone's stream. The knobs are `SchedulerConfig` fields;
docs/scheduling.md gives their reasons.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scheduler.config import SchedulerConfig
from scheduler.request import Request


def prefill_cost(start: int, num_tokens: int, attention_cost_context: int) -> int:
    """The cost, against a step's prefill cap, of computing prompt positions [start, start
    + num_tokens): a position at context c costs 1 + c / attention_cost_context tokens."""
    return num_tokens + num_tokens * (2 * start + num_tokens) // (2 * attention_cost_context)


def tokens_within(room: int, start: int, attention_cost_context: int) -> int:
    """The most tokens from position `start` whose prefill_cost fits in `room`."""
    if room <= 0:
        return 0
    k = attention_cost_context
    a = 1 + start / k  # cost(n) ~ a n + n^2 / (2 k): solve for n
    n = int(k * (math.sqrt(a * a + 2 * room / k) - a))
    while n > 0 and prefill_cost(start, n, k) > room:
        n -= 1
    while prefill_cost(start, n + 1, k) <= room:
        n += 1
    return n


def prefill_cap(config: SchedulerConfig, num_unfinished: int, has_decodes: bool) -> int | None:
    """The most prefill tokens (by `prefill_cost`), in all, a step (that `has_decodes`) carries:
    max(long_prefill_token_threshold, prefill_tokens_per_request x the batch about to
    decode); None (only the budget) for a step without decodes (a lone prefill delays
    nobody) or with the threshold off.

    NOTE: the batch about to decode is every unfinished request, up to the seats, not
    just this step's decodes: in a burst the first few streams' steps soon grow to
    the whole batch's, so admission runs at the rate the full batch allows instead of
    starting from the few decodes that exist at first.
    """
    threshold = config.long_prefill_token_threshold
    if not threshold or not has_decodes:
        return None
    num_batch = min(num_unfinished, config.max_num_seqs)
    return max(threshold, config.prefill_tokens_per_request * num_batch)


@dataclass
class StepBudget:
    """What one step may still schedule: `budget` tokens and, once its decodes are
    scheduled, `prefill_room` of prefill cost (None: only the budget bounds prefills)."""

    config: SchedulerConfig
    budget: int = field(init=False)
    whole_prompt_slack: float = field(init=False)
    attention_cost_context: int = field(init=False)  # prefill_cost's k in this step
    # request id -> tokens to compute, in scheduling order
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    decode_ids: set[str] = field(default_factory=set)
    prefill_room: int | None = None
    prefill_costs: dict[str, int] = field(default_factory=dict)
    # what a prompt chunk costs against the room whatever its size, per chunk and per
    # position of context before it (the slo policy's fit of the device; 0 otherwise)
    chunk_units: float = 0.0
    chunk_context_units: float = 0.0
    # speculative decoding: request id -> the draft tokens its decode verifies
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # draft-model speculation: request id -> the draft tokens to propose after the step
    num_lookahead_tokens: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.budget = self.config.max_num_batched_tokens
        self.whole_prompt_slack = self.config.whole_prompt_slack
        self.attention_cost_context = self.config.attention_cost_context

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens granted so far."""
        return sum(len(d) for d in self.draft_token_ids.values())

    def schedule(self, request: Request, num_tokens: int, *, decode: bool = False) -> None:
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.budget -= num_tokens
        if decode:
            self.decode_ids.add(request.request_id)
        elif self.prefill_room is not None:
            start = request.num_computed_tokens
            cost = prefill_cost(start, num_tokens, self.attention_cost_context)
            cost += self.chunk_cost(start)
            self.prefill_costs[request.request_id] = cost
            self.prefill_room -= cost

    def add_drafts(self, request: Request, draft_token_ids: list[int]) -> None:
        """A decode scheduled in this step verifies `draft_token_ids` too."""
        self.num_scheduled_tokens[request.request_id] += len(draft_token_ids)
        self.budget -= len(draft_token_ids)
        self.draft_token_ids[request.request_id] = draft_token_ids

    def unschedule(self, request: Request) -> None:
        """A victim scheduled earlier in this step gives its tokens back."""
        num_tokens = self.num_scheduled_tokens.pop(request.request_id, 0)
        self.budget += num_tokens
        self.decode_ids.discard(request.request_id)
        self.draft_token_ids.pop(request.request_id, None)
        self.num_lookahead_tokens.pop(request.request_id, None)
        if self.prefill_room is not None:
            self.prefill_room += self.prefill_costs.pop(request.request_id, 0)

    def chunk_cost(self, start: int) -> int:
        """What a prompt chunk from position `start` costs against the room whatever its
        size."""
        return math.ceil(self.chunk_units + self.chunk_context_units * start)

    def has_prefill_room(self) -> bool:
        """Whether another prompt chunk may start: room left, beyond a chunk's own cost
        once one chunk has the step's progress."""
        if self.budget <= 0:
            return False
        if self.prefill_room is None:
            return True
        return self.prefill_room > (self.chunk_cost(0) if self.prefill_costs else 0)

    def prefill_tokens_left(self, start: int) -> int:
        """The most tokens a prefill from position `start` may compute in this step (at
        least 1 while there is room)."""
        if self.prefill_room is None:
            return self.budget
        room = tokens_within(self.prefill_room - self.chunk_cost(start), start,
                             self.attention_cost_context)
        return min(self.budget, max(1, room))

    def admission_tokens(self, start: int, num_new: int) -> int:
        """The tokens a prompt being admitted computes in this step: all `num_new` from
        position `start` if their cost is within whole_prompt_slack x the room (and the
        budget), else what `prefill_tokens_left` allows."""
        if (
            self.prefill_room is not None
            and num_new <= self.budget
            and prefill_cost(start, num_new, self.attention_cost_context)
            + self.chunk_cost(start) <= self.prefill_room * self.whole_prompt_slack
        ):
            return num_new
        return min(num_new, self.prefill_tokens_left(start))
