"""A request's output constraint as one grammar (API process), checked before it is sent.

`response_format` (OpenAI: json_object, json_schema) and vLLM's `structured_outputs`
(json, regex, choice, grammar, json_object) on either route, or the forced tool call of a
chat request (server/tool_parsers.py), become the llguidance grammar that the engine core
compiles and enforces (structured/). Before anything is built, the constraint's text is
held to its budgets (server/limits.py): its size (--max-grammar-bytes) and the nesting of
a JSON schema or Lark grammar (--max-grammar-depth, measured without recursion). A
constraint over them, or one that cannot compile, is a GrammarError naming the field and
why: the route answers 400. (The tokenizer-aware compile and first mask follow in
server/serving.py, bounded by --grammar-timeout-s.)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from server.limits import RequestLimits, over_limit
from server.requests import ResponseFormat, SamplingRequest, StructuredOutputsParams
from structured.grammars import (
    check_grammar,
    choice_grammar,
    json_object_grammar,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
)

_T = TypeVar("_T")


class GrammarError(ValueError):
    """A constraint that does not compile; `param` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class Constraint(NamedTuple):
    """A request's grammar and the field it comes from."""

    param: str
    grammar: str


def request_grammar(
    body: SamplingRequest,
    limits: RequestLimits,
    forced_tool: Callable[[], str | None] | None = None,
) -> Constraint | None:
    """The grammar constraining `body`'s output (None: unconstrained), within `limits`
    and checked; a GrammarError when it is over a budget or does not compile.
    `forced_tool` builds a forced tool call's grammar (None when the call is not forced)."""
    if forced_tool is not None:
        grammar = _built("tool_choice", limits, forced_tool)
        if grammar is not None:
            return _checked("tool_choice", grammar)
    if body.structured_outputs is not None:
        params = body.structured_outputs
        grammar = _built("structured_outputs", limits,
                         lambda: _structured_outputs_grammar(params, limits))
        return _checked("structured_outputs", grammar)
    if body.response_format is not None:
        response_format = body.response_format
        built = _built("response_format", limits,
                       lambda: _response_format_grammar(response_format, limits))
        return None if built is None else _checked("response_format", built)
    return None


def _built(param: str, limits: RequestLimits, build: Callable[[], _T]) -> _T:
    """`build()`; a RecursionError (nesting our own checks missed) is a GrammarError."""
    try:
        return build()
    except GrammarError:
        raise
    except RecursionError as exc:
        raise GrammarError(param, _too_deep("the constraint is nested too deeply", limits)) \
            from exc


def _response_format_grammar(response_format: ResponseFormat, limits: RequestLimits) -> str | None:
    if response_format.type == "json_object":
        return json_object_grammar()
    if response_format.type == "json_schema" and response_format.json_schema is not None:
        schema = response_format.json_schema.json_schema
        _check_schema_size("response_format", schema, limits)
        return _schema_grammar("response_format", schema)
    return None


def _structured_outputs_grammar(params: StructuredOutputsParams, limits: RequestLimits) -> str:
    param = "structured_outputs"
    if params.json_ is not None:
        schema = params.json_
        if isinstance(schema, str):
            _check_bytes(param, "json", len(schema.encode()), limits)
            try:
                schema = json.loads(schema)
            except RecursionError as exc:
                raise GrammarError(param, _too_deep("json is nested too deeply", limits)) from exc
            except ValueError as exc:
                raise GrammarError(param, f"json is not valid JSON: {exc}") from exc
            if not isinstance(schema, dict | bool):
                raise GrammarError(param, "json must be a JSON schema object")
        _check_schema_size(param, schema, limits)
        return _schema_grammar(param, schema)
    if params.regex is not None:
        _check_bytes(param, "regex", len(params.regex.encode()), limits)
        return regex_grammar(params.regex)
    if params.choice is not None:
        _check_bytes(param, "choice", sum(len(c.encode()) for c in params.choice), limits)
        return choice_grammar(params.choice)
    if params.grammar is not None:
        _check_bytes(param, "grammar", len(params.grammar.encode()), limits)
        depth = lark_depth(params.grammar)
        if depth > limits.max_grammar_depth:
            raise GrammarError(param, _too_deep(f"grammar nests {depth} levels deep", limits))
        return lark_grammar(params.grammar)
    return json_object_grammar()


def _check_schema_size(param: str, schema: Any, limits: RequestLimits) -> None:
    """A parsed JSON schema within the nesting and size budgets (nesting first: measuring
    the size writes the schema out, which recursion bounds)."""
    depth = json_depth(schema, limits.max_grammar_depth)
    if depth > limits.max_grammar_depth:
        raise GrammarError(param, _too_deep("the JSON schema nests deeper than "
                                            f"{limits.max_grammar_depth} levels", limits))
    size = len(json.dumps(schema, ensure_ascii=False, separators=(",", ":")).encode())
    _check_bytes(param, "the JSON schema", size, limits)


def _check_bytes(param: str, what: str, size: int, limits: RequestLimits) -> None:
    if size > limits.max_grammar_bytes:
        raise GrammarError(param, over_limit(f"{what} is {size} bytes",
                                             limits.max_grammar_bytes, "max_grammar_bytes"))


def _too_deep(what: str, limits: RequestLimits) -> str:
    return over_limit(what, limits.max_grammar_depth, "max_grammar_depth")


def json_depth(value: Any, stop_above: int) -> int:
    """How deep objects and arrays nest in parsed JSON (a scalar: 0, `{}`: 1), without
    recursion; once past `stop_above` it returns at once (with a depth over it)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > stop_above:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def lark_depth(lark: str) -> int:
    """How deep (), [] and {} nest in a Lark grammar, outside its strings, regexes and
    comments (one pass; an embedded `%json` schema counts with its braces)."""
    depth = deepest = 0
    i, n = 0, len(lark)
    while i < n:
        char = lark[i]
        if char in "\"'" or (char == "/" and lark[i + 1:i + 2] != "/"):
            i = _literal_end(lark, i)  # a string or a /regex/
        elif char == "/":  # a // comment, to the end of the line
            end = lark.find("\n", i)
            i = n if end < 0 else end
        elif char in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in ")]}":
            depth = max(0, depth - 1)
        i += 1
    return deepest


def _literal_end(text: str, start: int) -> int:
    """The index of the quote that closes the literal opened at `start` (backslashes
    escape), or the end of its line."""
    quote, i = text[start], start + 1
    while i < len(text) and text[i] not in (quote, "\n"):
        i += 2 if text[i] == "\\" else 1
    return min(i, len(text))


def _schema_grammar(param: str, schema: dict[str, object] | bool) -> str:
    try:
        return json_schema_grammar(schema)
    except RecursionError:
        raise
    except Exception as exc:  # NOTE: whatever llguidance raises on odd input is a 400
        raise GrammarError(param, f"invalid JSON schema: {exc}") from exc


def _checked(param: str, grammar: str) -> Constraint:
    try:
        check_grammar(grammar)
    except Exception as exc:  # ValueError, or anything llguidance raises on odd input
        raise GrammarError(param, f"the engine cannot compile it: {exc}") from exc
    return Constraint(param, grammar)
