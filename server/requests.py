"""OpenAI-compatible request models (completions, chat), the bodies the routes parse.

Requests ignore unknown fields, take each field in the JSON type its schema names (strict:
`true` or "0.5" for a number, or 1 for a boolean, is a 400, as OpenAI answers; an
integral 7.0 is the integer 7, as JSON Schema has it), and bound every numeric field that
no flag governs. Every list (and logit_bias) is `limited` by a flag of server/limits.py,
counted before any of its items is validated, and stops at its first bad item; the other
bounds an operator sets (`n`, logprobs, stop strings' length, the tools' size:
server/limits.py) are checked after parsing, by `check_budgets`. A validation error
becomes an HTTP 400 (server/admission.py, server/errors.py) whose message names the field
and its limit. Structured outputs (`response_format`, vLLM's
`structured_outputs`), tools and vLLM's extra sampling fields (`logit_bias`,
`allowed_token_ids`, `skip_special_tokens`, `include_stop_str_in_output`) are here too;
server/structured_output.py turns the constraints into grammars. The responses are in
server/responses.py.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from scheduler.sampling_params import SamplingParams, unique_token_lists
from server.request_fields import FailFastList, limited, token_ids
from server.request_fields import JsonInt as JsonInt  # the routes' models take it from here
from server.slo import SloTargets

MAX_DEADLINE_MS = 7 * 24 * 3600 * 1000  # a week
MAX_CACHE_SALT_CHARS = 256
# the defaults of --max-stop-token-ids, --max-messages, --max-choice-strings (server/limits.py)
MAX_STOP_TOKEN_IDS = 256
MAX_MESSAGES = 2048
MAX_CHOICE_STRINGS = 1024
MAX_METADATA_PAIRS = 16  # OpenAI's
MIN_REPETITION_PENALTY = 0.01
# NOTE: a temperature this small is greedy: dividing float32 logits by it gives inf/NaN.
GREEDY_TEMPERATURE_EPS = 1e-5
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1  # n > 1 uses seed + i: still a valid seed
_MAX_TOKEN_ID_DIGITS = 18  # a logit_bias key: any longer is out of every vocabulary


# NOTE: the validators below check these fields by hand (for clearer messages); these JSON
# schemas tell the OpenAPI document (and so schemathesis) the same constraints.
_TOKEN_IDS_SCHEMA = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
_PROMPT_SCHEMA = WithJsonSchema({"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
    _TOKEN_IDS_SCHEMA,
    {"type": "array", "minItems": 1, "items": _TOKEN_IDS_SCHEMA},
]})
_STOP_STRING_SCHEMA = {"type": "string", "minLength": 1}
_STOP_SCHEMA = WithJsonSchema({"anyOf": [
    _STOP_STRING_SCHEMA,
    {"type": "array", "items": _STOP_STRING_SCHEMA},
    {"type": "null"},
]})
_STOP_TOKEN_IDS_SCHEMA = WithJsonSchema({"anyOf": [
    {"type": "array", "maxItems": MAX_STOP_TOKEN_IDS, "items": {"type": "integer", "minimum": 0}},
    {"type": "null"},
]})


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """response_format.json_schema: OpenAI's named schema (`strict` is always honoured)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema")
        return self


class StructuredOutputsParams(_Request):
    """vLLM's `structured_outputs`: exactly one of json (a schema, or its JSON text),
    regex, choice, grammar (Lark) or json_object."""

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str] | None, limited("max_choice_strings", "choices")] = Field(
        default=None, min_length=1, fail_fast=True)
    grammar: str | None = None
    json_object: bool | None = None

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    @model_validator(mode="after")
    def _check_one(self) -> StructuredOutputsParams:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(
                "give exactly one of json, regex, choice, grammar or json_object"
            )
        return self


class SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: JsonInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: JsonInt | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    n: JsonInt = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str | list[str] | None, _STOP_SCHEMA,
                    limited("max_stop_strings", "stop strings")] = None
    stop_token_ids: Annotated[list[JsonInt] | None, _STOP_TOKEN_IDS_SCHEMA,
                              limited("max_stop_token_ids", "token ids")] = Field(
        default=None, fail_fast=True)
    seed: JsonInt | None = Field(default=None, ge=_SEED_MIN, le=_SEED_MAX)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, ge=MIN_REPETITION_PENALTY, le=10.0)
    ignore_eos: bool = False
    min_tokens: JsonInt = Field(default=0, ge=0)
    priority: JsonInt = Field(default=0, ge=_INT32_MIN, le=_INT32_MAX)
    deadline_ms: JsonInt | None = Field(default=None, ge=1, le=MAX_DEADLINE_MS)
    slo: SloTargets | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: Annotated[dict[str, float] | None,
                          limited("max_logit_bias", "logit_bias entries")] = None
    allowed_token_ids: Annotated[list[JsonInt] | None,
                                 limited("max_allowed_token_ids", "token ids")] = Field(
        default=None, min_length=1, fail_fast=True)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: JsonInt | None = Field(default=None, ge=0)
    # speculative decoding: at most this many draft tokens a step (capped by the server's
    # --speculative-config; 0: none)
    num_speculative_tokens: JsonInt | None = Field(default=None, ge=0, le=_INT32_MAX)

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            # NOTE: isdigit alone takes "²" and "٣", which int() refuses.
            if not (key.isascii() and key.isdigit()) or len(key) > _MAX_TOKEN_ID_DIGITS:
                raise ValueError(f"keys must be token ids (ASCII decimal digits), not {key!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError("values must be in [-100, 100]")
        return bias

    @field_validator("allowed_token_ids")
    @classmethod
    def _check_allowed(cls, ids: list[int] | None) -> list[int] | None:
        """Deduplicated (in order): once in range, no more ids than the vocabulary."""
        if ids is None:
            return None
        if any(i < 0 for i in ids):
            raise ValueError("token ids must be >= 0")
        return list(dict.fromkeys(ids))

    @property
    def token_ids_to_check(self) -> list[int]:
        """Token ids in the sampling fields (each must be in the vocabulary)."""
        bias = [int(k) for k in self.logit_bias or {}]
        return [*(self.stop_token_ids or ()), *bias, *(self.allowed_token_ids or ())]

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stop

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and any(i < 0 for i in ids):
            raise ValueError("stop_token_ids must be >= 0")
        return ids

    @model_validator(mode="after")
    def _check_combinations(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be <= max_tokens")
        if self.structured_outputs is not None and self.response_format is not None and (
            self.response_format.type != "text"
        ):
            raise ValueError("give response_format or structured_outputs, not both")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def num_prompt_logprobs(self) -> int | None:
        """The top alternatives the engine computes per prompt token (None: no prompt
        logprobs)."""
        return self.prompt_logprobs

    def to_sampling_params(
        self, max_tokens: int, logprobs: int | None, grammar: str | None = None
    ) -> SamplingParams:
        """The scheduler/runner view of this request (stop strings stay in the server);
        `grammar` constrains the output (server/structured_output.py)."""
        top_k = self.top_k if self.top_k is not None else 0
        temperature = 1.0 if self.temperature is None else self.temperature
        if temperature < GREEDY_TEMPERATURE_EPS:
            temperature = 0.0
        allowed_token_ids, logit_bias = unique_token_lists(
            self.allowed_token_ids, [(int(k), float(v)) for k, v in (self.logit_bias or {}).items()]
        )
        return SamplingParams(
            temperature=temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(top_k, 0),
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=(
                1.0 if self.repetition_penalty is None else self.repetition_penalty
            ),
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=self.num_prompt_logprobs,
            grammar=grammar,
            logit_bias=logit_bias,
            allowed_token_ids=allowed_token_ids,
            num_speculative_tokens=self.num_speculative_tokens,
        )


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. `prompt`: a string, strings, token ids, or lists of ids.
    `echo` with `logprobs` scores the prompt too (its tokens' logprobs, through the prompt
    logprobs); `max_tokens` 0 with `echo` scores it alone (as vLLM does)."""

    # NOTE: each list stops at its first bad item: the union tries the lists in turn
    prompt: Annotated[str | FailFastList[list[str]] | FailFastList[list[int]]
                      | FailFastList[list[list[int]]], _PROMPT_SCHEMA]
    max_tokens: JsonInt | None = Field(default=None, ge=0)
    logprobs: JsonInt | None = Field(default=None, ge=0)
    echo: bool = False

    @model_validator(mode="after")
    def _check_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 is only allowed with echo (the prompt scored alone)")
        return self

    @property
    def scores_prompt_only(self) -> bool:
        """max_tokens 0: the echoed prompt alone, nothing generated."""
        return self.max_tokens == 0

    @property
    def num_prompt_logprobs(self) -> int | None:
        """With echo and logprobs, at least `logprobs` (the echoed prompt's top-k)."""
        if not self.echo or self.logprobs is None:
            return self.prompt_logprobs
        return max(self.logprobs, self.prompt_logprobs or 0)

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, prompt: Any, info: ValidationInfo) -> Any:
        if isinstance(prompt, str):
            return prompt
        if not isinstance(prompt, list) or not prompt:
            raise ValueError("prompt must be a string, a list of strings or a list of token ids")
        if info.context is not None:
            _count_prompts(prompt, info.context)
        if isinstance(prompt[0], str):
            if all(isinstance(p, str) for p in prompt):
                return prompt
        elif isinstance(prompt[0], list):
            lists = [token_ids(p) if isinstance(p, list) and p else None for p in prompt]
            if all(ids is not None for ids in lists):
                return lists
        else:
            ids = token_ids(prompt)
            if ids is not None:
                return ids
        raise ValueError(
            "prompt must be a string, a list of strings, a list of token ids (ints >= 0) "
            "or a list of non-empty lists of token ids"
        )

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt as a list of prompts (each a string or a list of token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [p]
        return p


def _count_prompts(prompt: list[Any], budgets: Any) -> None:
    """The prompts (`max_choices`: prompts x n, so prompts alone) and token ids
    (`max_prompt_token_ids`) of a prompt list against their limits, before any is read."""
    if not isinstance(prompt[0], list | str):  # token ids
        budgets.take("max_prompt_token_ids", len(prompt), "prompt token ids")
        return
    budgets.take("max_choices", len(prompt), "prompts")
    if isinstance(prompt[0], list):
        num_ids = sum(len(p) for p in prompt if isinstance(p, list))
        budgets.take("max_prompt_token_ids", num_ids, "prompt token ids")


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; extra keys (tool_call_id, ...) pass through to the template."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | Annotated[list[TextContentPart], Field(fail_fast=True)] | None,
                       limited("max_content_parts", "content parts in all messages")] = None
    name: str | None = None

    def to_template_dict(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "\n".join(part.text for part in self.content)
        elif self.content is None:
            message["content"] = ""
        tool_calls = message.get("tool_calls")
        if isinstance(tool_calls, list):  # templates read the arguments as a mapping
            message["tool_calls"] = [_template_tool_call(c) for c in tool_calls]
        return message


def _template_tool_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}}
    )
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], limited("max_messages", "messages")] = Field(
        min_length=1, fail_fast=True)
    max_completion_tokens: JsonInt | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: JsonInt | None = Field(default=None, ge=0)
    tools: Annotated[list[ChatTool] | None, limited("max_tools", "tools")] = Field(
        default=None, fail_fast=True)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice 'required' or a named function needs tools")
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or ()]
            if choice.function.name not in names:
                raise ValueError(f"tool_choice names {choice.function.name!r}, which is not "
                                 f"in tools ({', '.join(names)})")
        if self.forces_tool_call and (
            self.structured_outputs is not None
            or (self.response_format is not None and self.response_format.type != "text")
        ):
            raise ValueError("a forced tool call cannot be combined with a response format")
        return self

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """"none" without tools; OpenAI's default with tools is "auto"."""
        if not self.tools:
            return "none"
        return self.tool_choice or "auto"

    @property
    def forces_tool_call(self) -> bool:
        """tool_choice "required" or a named function: the grammar makes the call."""
        return self.effective_tool_choice not in ("none", "auto")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
