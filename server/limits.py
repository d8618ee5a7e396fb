"""Per-request budgets: every cost a client's input can make grow, with the flag that sets
it. Each is checked before the work it bounds, and a request over one gets a 400 (413 for
the body) whose message names the limit and its flag (`over_limit`).

The fields and their flags are listed once, in `LIMIT_FLAGS`: server/cli.py adds a flag
per entry (the "request limits" group of `pagedserve serve --help`), and the table of
docs/operations.md lists the same. `check_budgets` checks a parsed request's fields
against them (both generation routes, before any work); `check_prompt_logprobs` what only
its tokens tell.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields

from server.errors import APIError
from server.requests import (
    MAX_CHOICE_STRINGS,
    MAX_MESSAGES,
    MAX_STOP_TOKEN_IDS,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
)


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for (see LIMIT_FLAGS for each field's meaning)."""

    max_body_bytes: int = 8 * 1024**2
    max_json_values: int = 512 * 1024
    max_n: int = 16
    max_choices: int = 128
    max_prompt_token_ids: int = 256 * 1024
    max_messages: int = MAX_MESSAGES
    max_content_parts: int = 4096
    max_logprobs: int = 20
    max_prompt_logprobs_entries: int = 100_000
    max_stop_strings: int = 4
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS
    max_logit_bias: int = 1024
    max_allowed_token_ids: int = 256 * 1024
    max_choice_strings: int = MAX_CHOICE_STRINGS
    max_tools: int = 128
    max_tools_bytes: int = 256 * 1024
    max_grammar_bytes: int = 64 * 1024
    max_grammar_depth: int = 64
    max_tool_arguments_depth: int = 64
    grammar_timeout_s: float = 2.0
    grammar_step_timeout_s: float = 1.0
    chat_template_timeout_s: float = 2.0
    trust_request_chat_template: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):
                continue
            if value <= 0:
                raise ValueError(f"{flag_of(f.name)} must be > 0")
        if self.max_body_bytes < 1024:
            raise ValueError(f"{flag_of('max_body_bytes')} must be >= 1024")


# field -> (flag help); the flag is the field's name with dashes.
LIMIT_FLAGS: dict[str, str] = {
    "max_body_bytes": "request bodies larger than this are a 413",
    "max_json_values": "JSON values (strings, numbers, arrays, objects...) in the fields a "
    "route reads at most, counted before they are decoded (unknown fields never are)",
    "max_n": "choices per prompt (`n`) at most",
    "max_choices": "choices per request (prompts x n; each is a sequence of its own) at most",
    "max_prompt_token_ids": "token ids of a completion request's prompts (all together) at "
    "most",
    "max_messages": "messages (or Responses input items) per request at most",
    "max_content_parts": "content parts of a request's messages (all together) at most",
    "max_logprobs": "top logprobs per token at most (logprobs, top_logprobs, prompt_logprobs)",
    "max_prompt_logprobs_entries": "prompt_logprobs (or echo with logprobs) entries a "
    "request may ask for: prompt tokens x (k + 1) x choices",
    "max_stop_strings": "stop strings per request at most",
    "max_stop_string_chars": "characters per stop string at most",
    "max_stop_token_ids": "stop_token_ids per request at most",
    "max_logit_bias": "logit_bias entries at most",
    "max_allowed_token_ids": "allowed_token_ids per request at most",
    "max_choice_strings": "strings of a structured_outputs choice at most",
    "max_tools": "tools per request at most",
    "max_tools_bytes": "bytes of the tools' JSON (names, descriptions, schemas) at most",
    "max_grammar_bytes": "bytes of a structured-output constraint (schema, regex, Lark "
    "grammar, choices) at most",
    "max_grammar_depth": "nesting depth of a JSON schema or Lark grammar at most",
    "max_tool_arguments_depth": "nesting depth of a tool call's arguments in the messages "
    "(or Responses input) at most",
    "grammar_timeout_s": "seconds a grammar may take to compile and compute its first mask "
    "(a 400 beyond)",
    "grammar_step_timeout_s": "seconds a step waits for the grammar masks of its requests; "
    "a request whose mask is later fails alone with an error, the step goes on",
    "chat_template_timeout_s": "seconds a chat template may take to render (a 400 beyond; "
    "a request's own template, rendered in a worker process, is killed then whatever it "
    "does)",
    "trust_request_chat_template": "accept a request's own chat template "
    "(chat_template_kwargs.chat_template), rendered in a worker process killed at "
    "--chat-template-timeout-s; refused by default",
}


def flag_of(field_name: str) -> str:
    """`max_n` -> `--max-n`."""
    return "--" + field_name.replace("_", "-")


def over_limit(what: str, limit: float, field_name: str) -> str:
    """The message of a request over a budget: what, the limit and the flag that sets it."""
    return f"{what}: the limit is {limit} (set by {flag_of(field_name)})."


class ListBudgets:
    """The list limits of one body as it is validated (pydantic's validation context, given
    by `Admission.parse_json`): each list the request models mark `limited` is counted
    before any of its items is validated, and refused past its limit; the lists under one
    limit count together (the content parts of all messages)."""

    def __init__(self, limits: RequestLimits) -> None:
        self.limits = limits
        self.counts: dict[str, int] = {}

    def take(self, field_name: str, num_items: int, noun: str) -> None:
        """Count `num_items` more against the limit `field_name`: a ValueError (pydantic's
        error, a 400 naming the flag) past it."""
        total = self.counts.get(field_name, 0) + num_items
        self.counts[field_name] = total
        limit = getattr(self.limits, field_name)
        if total > limit:
            raise ValueError(over_limit(f"{total} {noun}", limit, field_name))


def check_budgets(body: SamplingRequest, limits: RequestLimits) -> None:
    """A 400 naming the first of `limits` that `body` is over and its flag, checked before
    any work is done for it (tokens, templates, grammars); then the choices (prompts x n)."""
    for param, what, amount, field_name in _asked(body):
        limit = getattr(limits, field_name)
        if amount > limit:
            raise APIError(400, over_limit(what, limit, field_name), param=param)
    if isinstance(body, CompletionRequest):
        num_prompts = len(body.prompts)
        num_choices = num_prompts * body.n
        if num_choices > limits.max_choices:
            what = f"{num_prompts} prompts x n={body.n} is {num_choices} choices"
            raise APIError(400, over_limit(what, limits.max_choices, "max_choices"),
                           param="n")


def check_prompt_logprobs(
    prompts: list[list[int]], body: SamplingRequest, limits: RequestLimits
) -> None:
    """A 400 when the prompt logprobs asked for (prompt_logprobs, or echo with logprobs)
    are more entries than --max-prompt-logprobs-entries (each prompt's tokens x (k + 1) x
    its n choices); once tokenized, before submitting."""
    k = body.num_prompt_logprobs
    if k is None:
        return
    num_tokens = sum(len(p) for p in prompts)
    entries = num_tokens * (k + 1) * body.n
    limit = limits.max_prompt_logprobs_entries
    if entries > limit:
        param = "prompt_logprobs" if body.prompt_logprobs == k else "logprobs"
        asker = "prompt_logprobs" if param == "prompt_logprobs" else "echo with logprobs"
        what = (f"{asker} asks for {entries} prompt logprob entries ({num_tokens} prompt "
                f"tokens x ({k} + 1) x {body.n} choices)")
        raise APIError(400, over_limit(what, limit, "max_prompt_logprobs_entries"),
                       param=param)


def _asked(body: SamplingRequest) -> Iterator[tuple[str, str, int, str]]:
    """(param, what, amount, limit field) of each budgeted part of `body`, in order; each
    is measured only once those before it passed (the tools' size last)."""
    yield "n", f"n is {body.n}", body.n, "max_n"
    ks = {"prompt_logprobs": body.prompt_logprobs}
    if isinstance(body, CompletionRequest):
        ks["logprobs"] = body.logprobs
    if isinstance(body, ChatCompletionRequest):
        ks["top_logprobs"] = body.top_logprobs
    for param, k in ks.items():
        if k is not None:
            yield param, f"{param} is {k}", k, "max_logprobs"
    stops = body.stop_strings
    yield "stop", f"stop has {len(stops)} strings", len(stops), "max_stop_strings"
    longest = max(map(len, stops), default=0)
    yield ("stop", f"a stop string has {longest} characters", longest,
           "max_stop_string_chars")
    num_bias = len(body.logit_bias or ())
    yield "logit_bias", f"logit_bias has {num_bias} entries", num_bias, "max_logit_bias"
    tools = body.tools if isinstance(body, ChatCompletionRequest) else None
    if tools:
        yield "tools", f"tools has {len(tools)} entries", len(tools), "max_tools"
        size = sum(len(tool.model_dump_json().encode()) for tool in tools)
        yield "tools", f"the tools' JSON has {size} bytes", size, "max_tools_bytes"
