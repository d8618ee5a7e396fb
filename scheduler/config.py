"""Scheduler configuration."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits and policy of the scheduler.

    policy: "fcfs" or "priority". max_num_batched_tokens is the per-step token budget
    (chunked prefill splits prompts longer than what is left of it); max_num_seqs is the
    seat limit. priority_aging_s: a waiting request's effective priority improves by one
    level every that many seconds waited (None: off), but never past priority_aging_floor
    (nor past its tenant's bound): by default 0, the default priority, so that aging lifts
    background work to the level of ordinary traffic, never above requests that asked to be
    urgent. watermark: fraction of KV blocks
    kept free when admitting waiting requests (running requests may use them).
    long_prefill_token_threshold: a step that carries decodes computes at most
    max(long_prefill_token_threshold, prefill_tokens_per_request x the batch) prefill
    tokens in all (0: no cap beyond the budget), so that neither a long prompt nor many
    short ones turn everyone's next token into a long step; against that cap a prompt
    position at context c counts as 1 + c / attention_cost_context tokens, and a prompt
    being admitted whose cost is within whole_prompt_slack x the room left goes whole
    (scheduler/budget.py; docs/scheduling.md gives each knob's reason). fair_share:
    under priority, order each priority level by weighted fair share among tenants
    (scheduler/fair_share.py) instead of by arrival.
    async_scheduling: the engine core schedules step n+1 while step n runs on the device
    (overlapped steps; see engine/core.py).
    """

    policy: str = "fcfs"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    priority_aging_s: float | None = None
    priority_aging_floor: int = 0
    watermark: float = 0.0
    long_prefill_token_threshold: int = 0
    fair_share: bool = False
    async_scheduling: bool = False
    prefill_tokens_per_request: int = 2
    whole_prompt_slack: float = 1.5
    attention_cost_context: int = 2048

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {self.policy!r}: use fcfs or priority")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if self.priority_aging_s is not None and self.priority_aging_s <= 0:
            raise ValueError("priority_aging_s must be > 0")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError("watermark must be in [0, 1)")
        if self.prefill_tokens_per_request < 0:
            raise ValueError("prefill_tokens_per_request must be >= 0")
        if not self.whole_prompt_slack >= 1.0:  # NOTE: NaN fails too
            raise ValueError("whole_prompt_slack must be >= 1")
        if self.attention_cost_context < 1:
            raise ValueError("attention_cost_context must be >= 1")
