"""OpenAI-compatible response models: completions and chat (whole and as stream chunks),
usage, models and errors; `num_preemptions` is our per-choice extension and
`prompt_logprobs` vLLM's. The requests are in server/requests.py.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field

FinishReason = Literal["stop", "length", "abort", "deadline", "rejected", "tool_calls"]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry of a prompt token or one of its top alternatives."""

    logprob: float
    rank: int
    decoded_token: str


# One entry per prompt token (the first None), each keyed by token id as a string.
PromptLogprobsList = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    slo: dict[str, bool] | None = Field(default=None, exclude_if=lambda v: v is None)
    prompt_logprobs: PromptLogprobsList | None = Field(default=None, exclude_if=lambda v: v is None)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    num_preemptions: int | None = Field(default=None, exclude_if=lambda v: v is None)
    slo: dict[str, bool] | None = Field(default=None, exclude_if=lambda v: v is None)
    prompt_logprobs: PromptLogprobsList | None = Field(default=None, exclude_if=lambda v: v is None)


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: random_id("call"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = Field(default=None, exclude_if=lambda v: v is None)
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    slo: dict[str, bool] | None = Field(default=None, exclude_if=lambda v: v is None)
    prompt_logprobs: PromptLogprobsList | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaFunctionCall(BaseModel):
    name: str | None = Field(default=None, exclude_if=lambda v: v is None)
    arguments: str | None = Field(default=None, exclude_if=lambda v: v is None)


class DeltaToolCall(BaseModel):
    """A streamed piece of tool call `index`: the first one has id, type and name."""

    index: int
    id: str | None = Field(default=None, exclude_if=lambda v: v is None)
    type: Literal["function"] | None = Field(default=None, exclude_if=lambda v: v is None)
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=lambda v: v is None)
    content: str | None = Field(default=None, exclude_if=lambda v: v is None)
    reasoning_content: str | None = Field(default=None, exclude_if=lambda v: v is None)
    tool_calls: list[DeltaToolCall] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None
    num_preemptions: int | None = Field(default=None, exclude_if=lambda v: v is None)
    slo: dict[str, bool] | None = Field(default=None, exclude_if=lambda v: v is None)
    prompt_logprobs: PromptLogprobsList | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = Field(default=None, exclude_if=lambda v: v is None)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedserve"
    max_model_len: int
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (None: a base model)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
