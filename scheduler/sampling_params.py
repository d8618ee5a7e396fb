"""Per-request sampling and stopping parameters, shared by the scheduler and the runner."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """What to sample and when to stop.

    The scheduler reads the stopping fields (max_tokens, min_tokens, stop_token_ids,
    ignore_eos); the model runner reads the sampling fields. Stop *strings* are text and
    are applied by the server's detokenizer, which then finishes the request.
    temperature == 0 means greedy. top_k <= 0 means no top-k filtering.
    `grammar` constrains the output: an llguidance grammar (structured/grammars.py) that the
    engine core compiles and enforces with a token mask. `logit_bias` adds a bias to
    token ids' logits; `allowed_token_ids` (when set) masks every other token.
    `prompt_logprobs` (when set) asks for the logprob of every prompt token and its top
    alternatives: the whole prompt is then computed, whatever the prefix cache holds.
    `num_speculative_tokens` caps the draft tokens of this request under speculative
    decoding (None: the server's; 0: none); the server's setting caps it in turn.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return; None for none
    grammar: str | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    prompt_logprobs: int | None = None  # top alternatives per prompt token; None for none
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("logprobs must be >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError("prompt_logprobs must be >= 0")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_token_mask(self) -> bool:
        """Whether logit_bias or allowed_token_ids change the logits."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def unique_token_lists(
    allowed_token_ids: Iterable[int] | None, logit_bias: Iterable[tuple[int, float]]
) -> tuple[tuple[int, ...] | None, tuple[tuple[int, float], ...]]:
    """A request's allowed_token_ids without repeats (ascending) and its logit_bias with one
    entry per token (the last given wins, as in vLLM): the one place they are deduplicated,
    once per request, before anything copies or builds on them."""
    allowed = None if allowed_token_ids is None else tuple(sorted(set(allowed_token_ids)))
    return allowed, tuple(dict(logit_bias).items())
