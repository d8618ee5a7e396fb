"""The contract between the scheduler and the model runner.

`SchedulerOutput` is everything the runner needs for one step; `ModelRunnerOutput` is
everything the scheduler needs back. Both are plain Python so scheduler tests can build
them by hand without a model.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from scheduler.sampling_params import SamplingParams

# The input id of a token that an earlier step samples and that is not known yet when
# this step is scheduled (overlapped steps); the runner puts the sampled token there.
PLACEHOLDER_TOKEN_ID = -1


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    Positions of `token_ids` are num_computed_tokens .. num_computed_tokens + len - 1;
    the last may be PLACEHOLDER_TOKEN_ID (the token the previous step samples).
    `block_table` lists every KV block the request holds (it covers all those
    positions). `sample` is True when this chunk reaches the end of the request's known
    tokens (prompt plus outputs so far), so the runner samples one new token for it.
    `prompt_token_ids` and `output_token_ids` are the request's own lists (not copies):
    the runner reads them for penalties and must not mutate them.
    `prompt_logprob_rows` are the offsets [lo, hi) into `token_ids` of the positions whose
    logits give prompt logprobs still missing (the logits at position p give prompt token
    p + 1's); (0, 0) for none.
    `num_draft_tokens` (speculative decoding): the last that many of `token_ids` are
    proposed tokens after the request's last known one (then `sample` is set); the runner
    verifies them from the logits at every one of those positions and returns the
    accepted ones and one token more in `ModelRunnerOutput.verified_token_ids`.
    `num_lookahead_tokens` (draft-model speculation): after the step, the runner proposes
    that many draft tokens to follow the request's newest token, into
    `ModelRunnerOutput.draft_token_ids` (the block table already covers their KV slots:
    the newest token's position and the lookahead ones after it).
    `lora_name`: the LoRA adapter its rows run (None: the base model); the scheduler
    schedules only adapters the runner holds.
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    sample: bool
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    prompt_logprob_rows: tuple[int, int] = (0, 0)
    num_draft_tokens: int = 0
    num_lookahead_tokens: int = 0
    lora_name: str | None = None

    @property
    def draft_token_ids(self) -> list[int]:
        """The proposed tokens this step verifies (empty without speculation)."""
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:]

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens in the KV cache once this step has run (cached + new)."""
        return self.num_computed_tokens + len(self.token_ids)


@dataclass
class SchedulerOutput:
    """All the scheduler hands the runner for one step.

    `scheduled` is ordered: decodes and prefill chunks in any mix. `preempted_ids` and
    `finished_ids` name requests whose runner-side state (e.g. seeded generators) ends or
    pauses; a preempted request keeps its generator and resumes it later.
    `grammar_bitmask` is set by the engine core when sampling rows are constrained by a
    grammar: it is filled while the forward runs, and the runner waits for it before
    sampling.
    `lora_loads`: LoRA adapters the engine core is to load (off the step, on a thread);
    `lora_evictions`: those the runner drops before this step (scheduler/lora_slots.py).
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    lora_loads: list[str] = field(default_factory=list)
    lora_evictions: list[str] = field(default_factory=list)
    grammar_bitmask: Future[GrammarBitmask] | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class GrammarBitmask:
    """Token masks of a step's constrained rows: `rows` maps a request id to its row of
    `bitmask`, an int32 array [n >= len(rows), ceil(vocab / 32)] (numpy) in which bit t of
    a row allows token t (rows that `rows` does not name are unused). `failed` names the
    constrained rows that have no mask (it was late, or the grammar failed), with why:
    the engine core fails their requests after the step, whatever they sample.

    A request that verifies drafts has the masks after its first i drafts in the rows
    after its own, for i = 1 .. `num_draft_rows[id]` (absent: 0; fewer than its drafts
    when the later ones were late or rejected: those drafts are not accepted)."""

    rows: dict[str, int]
    bitmask: Any
    failed: dict[str, str] = field(default_factory=dict)
    num_draft_rows: dict[str, int] = field(default_factory=dict)


@dataclass
class SampleLogprobs:
    """Logprob of the sampled token and the top-N alternatives (token id, logprob)."""

    logprob: float
    top: list[tuple[int, float]]


@dataclass
class PromptLogprobs:
    """Logprobs of consecutive prompt tokens from prompt index `start` (>= 1: the first
    token has none). For each token: its logprob under the raw logits of the position
    before it, its rank there (1: the most likely token), and the top-k (token id,
    logprob) pairs, most likely first."""

    start: int
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)

    @property
    def end(self) -> int:
        """The prompt index after the last token held."""
        return self.start + len(self.logprobs)

    def extend(self, later: PromptLogprobs) -> None:
        """Append the tokens of `later` past `end`; those it repeats (a chunk computed
        again after a preemption) are dropped. ValueError if it leaves a gap."""
        if later.start > self.end:
            raise ValueError(f"prompt logprobs from {later.start}, expected {self.end}")
        skip = self.end - later.start
        self.logprobs += later.logprobs[skip:]
        self.ranks += later.ranks[skip:]
        self.top += later.top[skip:]


@dataclass
class ModelRunnerOutput:
    """Sampled tokens of one step, keyed by request id (only requests with sample=True),
    and the prompt logprobs of the chunks that had `prompt_logprob_rows`.

    A request that verified draft tokens is in `verified_token_ids` instead of
    `sampled_token_ids`: its accepted drafts (a prefix of them) then the one token sampled
    after them, and their logprobs (when asked for) in `verified_logprobs`. A runner that
    does not verify may answer such a request with one sampled token: no draft accepted.
    `draft_token_ids`: the draft model's proposals for the requests that had
    `num_lookahead_tokens` (a runner without a draft model gives none).
    """

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, SampleLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    verified_token_ids: dict[str, list[int]] = field(default_factory=dict)
    verified_logprobs: dict[str, list[SampleLogprobs]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)

