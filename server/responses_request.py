"""POST /v1/responses' body (OpenAI's Responses API) and its translation to a chat request.

The Responses route is a translation layer over the chat route: `instructions` and the
`input` items (messages, `function_call` and `function_call_output` items, `reasoning`
items) become chat messages, as the chat route renders an assistant's tool calls and the
tools' results through the model's chat template; the flat function tools, `tool_choice`,
`text.format`, `max_output_tokens` and the sampling fields become their chat fields, so
that every check and budget of the chat route (server/limits.py, server/admission.py)
applies unchanged. The Responses objects and events are in server/responses_events.py.

Like the other bodies, unknown fields are ignored and every field is strict. What this
server cannot do is a 400 naming the field: stored responses (`store: true`,
`previous_response_id`, `conversation`), `background`, hosted tools, and input parts other
than text (images, files).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, model_validator

from server.errors import APIError, validation_error
from server.request_fields import at_most, limited
from server.requests import (
    MAX_METADATA_PAIRS,
    ChatCompletionRequest,
    FunctionDefinition,
    JsonInt,
)

_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_TEXT_PART_TYPES = ("input_text", "output_text", "refusal")


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(_Request):
    """A text part of a message's content (input_text, output_text, or a refusal)."""

    type: Literal["input_text", "output_text", "refusal"]
    text: str = ""
    refusal: str = ""

    @property
    def value(self) -> str:
        return self.refusal if self.type == "refusal" else self.text


def _check_parts(content: Any) -> Any:
    """A message's content: its parts must be text (images and files are not served)."""
    if isinstance(content, list):
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in _TEXT_PART_TYPES:
                raise ValueError(f"content parts of type {kind!r} are not supported: this "
                                 f"server takes text only ({', '.join(_TEXT_PART_TYPES)})")
    return content


# NOTE: a list's limit is counted before its items are read: `limited` comes last (the
# last before-validator runs first)
_PARTS = limited("max_content_parts", "content parts in all items")
Content = Annotated[str | Annotated[list[TextPart], Field(fail_fast=True)],
                    pydantic.BeforeValidator(_check_parts), _PARTS]


def _text_of(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.value for p in content)


class MessageItem(_Request):
    """A message: the user's, the system's or developer's, or an earlier answer."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content


class FunctionCallItem(_Request):
    """A function call the model made earlier (its output is a later item)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(_Request):
    """A function call's result."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Content


class ReasoningText(_Request):
    text: str


class ReasoningItem(_Request):
    """Reasoning the model gave earlier (its text as content, or only its summary)."""

    type: Literal["reasoning"]
    summary: Annotated[list[ReasoningText], _PARTS] = Field(default_factory=list,
                                                             fail_fast=True)
    content: Annotated[list[ReasoningText] | None, _PARTS] = Field(default=None, fail_fast=True)

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content or self.summary)


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
    Field(discriminator="type"),
]


def _check_items(items: Any) -> Any:
    """Each item's type (a message when it has none): one this server reads."""
    if not isinstance(items, list):
        return items
    checked = []
    for item in items:
        if isinstance(item, dict):
            kind = item.get("type", "message")
            if kind not in _ITEM_TYPES:
                raise ValueError(f"items of type {kind!r} are not supported (this server "
                                 f"reads {', '.join(_ITEM_TYPES)})")
            item = {**item, "type": kind}
        checked.append(item)
    return checked


class FunctionTool(FunctionDefinition):
    """A function tool, in the Responses API's flat shape."""

    type: Literal["function"]


def _check_tools(tools: Any) -> Any:
    if isinstance(tools, list):
        for tool in tools:
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tools of type {kind!r} are not supported: this server "
                                 "calls function tools only")
    return tools


class FunctionToolChoice(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    """text.format: plain text, any JSON object, or JSON to a named schema."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> TextFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a format of type json_schema needs a schema")
        return self


class TextConfig(_Request):
    format: TextFormat | None = None


class ResponsesRequest(_Request):
    """POST /v1/responses (with `priority` and vLLM's sampling extras, as on the other
    routes)."""

    model: str | None = None
    input: Annotated[str, Field(min_length=1)] | Annotated[
        list[InputItem], Field(min_length=1, fail_fast=True),
        pydantic.BeforeValidator(_check_items), limited("max_messages", "input items")]
    instructions: str | None = None
    tools: Annotated[list[FunctionTool] | None, pydantic.BeforeValidator(_check_tools),
                     limited("max_tools", "tools")] = Field(default=None, fail_fast=True)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None  # effort, summary: the server's parser decides
    max_output_tokens: JsonInt | None = Field(default=None, ge=1)
    # NOTE: the chat request bounds these (the same names): `chat_request`
    temperature: float | None = None
    top_p: float | None = None
    top_k: JsonInt | None = None
    min_p: float | None = None
    seed: JsonInt | None = None
    repetition_penalty: float | None = None
    priority: JsonInt | None = None
    deadline_ms: JsonInt | None = None
    slo: dict[str, Any] | None = None
    cache_salt: str | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    metadata: Annotated[dict[str, str] | None,
                        at_most(MAX_METADATA_PAIRS, "metadata pairs")] = None
    user: str | None = None


# The fields a chat request takes as they are (and bounds).
_SAMPLING_FIELDS = {"model", "temperature", "top_p", "top_k", "min_p", "seed",
                    "repetition_penalty", "priority", "deadline_ms", "slo", "cache_salt",
                    "user"}

_NOT_STORED = ("this server keeps no responses (store: false), so it cannot continue "
               "one: send the whole conversation in `input`")


def check_supported(body: ResponsesRequest) -> None:
    """A 400 naming the first field that asks for what this server does not do."""
    if body.store:
        raise APIError(400, "store: true is not supported: " + _NOT_STORED + ".",
                       param="store")
    if body.previous_response_id is not None:
        raise APIError(400, "previous_response_id is not supported: " + _NOT_STORED + ".",
                       param="previous_response_id")
    if body.conversation is not None:
        raise APIError(400, "conversation is not supported: " + _NOT_STORED + ".",
                       param="conversation")
    if body.background:
        raise APIError(400, "background: true is not supported: this server answers "
                       "while the client waits (stream for progress).", param="background")


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request `body` asks for (after `check_supported`); a 400 when it is not a
    valid one (a tool_choice naming no tool, a forced call with a format, ...)."""
    chat: dict[str, Any] = {
        "messages": chat_messages(body),
        "stream": body.stream,
        "parallel_tool_calls": body.parallel_tool_calls,
        **body.model_dump(include=_SAMPLING_FIELDS, exclude_none=True),
    }
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"},
                                                                           exclude_none=True)}
                         for t in body.tools]
    choice = body.tool_choice
    if isinstance(choice, FunctionToolChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        chat["tool_choice"] = choice
    text_format = body.text.format if body.text is not None else None
    if text_format is not None:
        chat["response_format"] = _response_format(text_format)
    try:
        request = ChatCompletionRequest.model_validate(chat)
    except pydantic.ValidationError as exc:
        raise validation_error(exc.errors(include_url=False)) from exc
    return request


def _response_format(text_format: TextFormat) -> dict[str, Any]:
    if text_format.type != "json_schema":
        return {"type": text_format.type}
    schema = text_format.model_dump(include={"name", "description", "json_schema", "strict"},
                                    by_alias=True, exclude_none=True)
    return {"type": "json_schema", "json_schema": schema}


def chat_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """`instructions` as the system message, then the input items as chat messages: an
    assistant's reasoning, text and function calls in a row are one assistant message (its
    `reasoning_content`, `content` and `tool_calls`), a call's output a `tool` message.

    NOTE: linear in the input: each answer's texts are gathered and joined once (adding
    them one by one copied the answer so far per item, quadratic in its length)."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return [*system, {"role": "user", "content": body.input}]
    messages: list[dict[str, Any] | _Answer] = [*system]
    answer: _Answer | None = None
    for item in body.input:
        if isinstance(item, MessageItem) and item.role != "assistant":
            answer = None
            messages.append({"role": item.role, "content": _text_of(item.content)})
        elif isinstance(item, FunctionCallOutputItem):
            answer = None
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text_of(item.output)})
        else:
            if answer is None or not answer.continues_with(item):
                answer = _Answer()
                messages.append(answer)
            answer.add(item)
    return [m.message() if isinstance(m, _Answer) else m for m in messages]


class _Answer:
    """An earlier answer's parts in a row (reasoning, text, calls), as one assistant
    message once all are in."""

    def __init__(self) -> None:
        self.reasoning: list[str] | None = None
        self.content: list[str] = []
        self.has_content = False
        self.tool_calls: list[dict[str, Any]] = []

    def continues_with(self, item: MessageItem | FunctionCallItem | ReasoningItem) -> bool:
        """Whether `item` belongs to this answer: an answer's parts come in the order
        reasoning, text, calls."""
        if isinstance(item, ReasoningItem):
            return not (self.has_content or self.tool_calls)
        return not (isinstance(item, MessageItem) and self.tool_calls)

    def add(self, item: MessageItem | FunctionCallItem | ReasoningItem) -> None:
        if isinstance(item, ReasoningItem):
            self.reasoning = [] if self.reasoning is None else self.reasoning
            self.reasoning.append(item.text)
        elif isinstance(item, MessageItem):
            text = _text_of(item.content)
            self.content.append(text)
            self.has_content = self.has_content or bool(text)
        else:
            self.tool_calls.append({
                "id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            })

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content)}
        if self.reasoning is not None:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message
