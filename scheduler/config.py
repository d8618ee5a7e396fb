"""Scheduler configuration."""

from __future__ import annotations

import json
from dataclasses import astuple, dataclass, fields
from typing import Any

from scheduler.step_cost import DEFAULT_SEED, StepCost


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (`--speculative-config`, vLLM's keys).

    A decoding request proposes up to num_speculative_tokens tokens. method "ngram": those
    that followed the most recent earlier occurrence of its last n tokens (n from
    prompt_lookup_max down to prompt_lookup_min) within its last prompt_lookup_window
    tokens (prompt and output). method "draft_model": the greedy tokens of the draft
    model `model` (a local folder or .gguf on the target's tokenizer), run by the model
    runner after each step (model_runner/draft_model.py); a "model" without a "method"
    means draft_model, as in vLLM. The step verifies them beside everyone's work
    (scheduler/speculation.py).
    max_num_verify_tokens bounds a step's decodes plus draft tokens: drafts are granted
    in priority order within it, so as the batch grows speculation stops, the least
    urgent first, and with that many decodes it is off.
    """

    method: str = "ngram"
    model: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_window: int = 2048
    max_num_verify_tokens: int = 32

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}: use ngram or "
                             "draft_model")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError('--speculative-config: "model" (the draft model: a local folder '
                             'or .gguf) goes with method draft_model, and only with it')
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}]"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.prompt_lookup_window <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_window must be > prompt_lookup_max")
        if self.max_num_verify_tokens < 2:
            raise ValueError("max_num_verify_tokens must be >= 2")

    @classmethod
    def from_json(cls, text: str, draft_model: str | None = None) -> SpeculativeConfig:
        """The config of a `--speculative-config` JSON object (with `draft_model`, the
        `--speculative-model` flag: its "model"); ValueError naming what is wrong (not
        JSON, an unknown key, a value of the wrong type or out of range)."""
        try:
            values: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"--speculative-config: unknown keys {unknown}: use {sorted(known)}")
        if draft_model is not None:
            if values.get("method", "draft_model") != "draft_model" or "model" in values:
                raise ValueError("--speculative-model is the draft model: give no other "
                                 'method or "model" in --speculative-config')
            values["model"] = draft_model
        if "model" in values:
            values.setdefault("method", "draft_model")
        for key, value in values.items():
            wanted = str if known[key] in ("str", "str | None") else int
            if type(value) is not wanted:  # NOTE: not isinstance: a bool is not an int here
                raise ValueError(f"--speculative-config: {key} must be {wanted.__name__}")
        return cls(**values)


SPECULATIVE_METHODS = ("ngram", "draft_model")
# The most draft tokens a request may verify in one step (the flag and the request field).
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits and policy of the scheduler.

    policy: "fcfs", "priority" or "slo" (priority, then the latency targets:
    scheduler/slo.py). max_num_batched_tokens is the per-step token budget
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
    step_cost_seed: the step-cost model's coefficients before any step ran
    (scheduler/step_cost.py); calibrate_step_cost: the engine core replaces the seed by
    a few timed steps at start (engine/calibration.py). The slo policy plans with the
    model as the steps refit it.
    async_scheduling: the engine core schedules step n+1 while step n runs on the device
    (overlapped steps; see engine/core.py). speculative: speculative decoding, by n-gram
    or a draft model (None: off). max_loras: LoRA adapters in one step (None: no
    adapters), max_cpu_loras: adapters kept loaded (None: max_loras); the slots go by
    priority (scheduler/lora_slots.py). background_priority: requests at this priority or
    worse (the Batch API's lines) carry no latency promise: a step whose decodes are all
    background ones takes prefill work up to the budget, uncapped (None: every decode is
    protected by the cap).
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
    speculative: SpeculativeConfig | None = None
    step_cost_seed: StepCost = DEFAULT_SEED
    calibrate_step_cost: bool = False
    max_loras: int | None = None
    max_cpu_loras: int | None = None
    background_priority: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority", "slo"):
            raise ValueError(f"unknown scheduling policy {self.policy!r}: use fcfs, priority "
                             "or slo")
        if self.policy == "slo" and self.priority_aging_s is not None:
            raise ValueError("priority aging is not combined with the slo policy: slack "
                             "already serves the waiting requests that can still be on time")
        if not all(c >= 0 for c in astuple(self.step_cost_seed)):
            raise ValueError("step_cost_seed: coefficients >= 0")
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
