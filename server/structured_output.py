"""A request's output constraint as one grammar (API process), checked before it is sent.

`response_format` (OpenAI: json_object, json_schema) and vLLM's `structured_outputs`
(json, regex, choice, grammar, json_object) on either route, or the forced tool call of a
chat request (server/tool_parsers.py), become the llguidance grammar that the engine core
compiles and enforces (structured/). A constraint that cannot compile is a ValueError
naming the field and why: the route answers 400.
"""

from __future__ import annotations

import json

from server.protocol import ResponseFormat, SamplingRequest, StructuredOutputsParams
from structured.grammars import (
    check_grammar,
    choice_grammar,
    json_object_grammar,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
)


class GrammarError(ValueError):
    """A constraint that does not compile; `param` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def request_grammar(body: SamplingRequest, tool_grammar: str | None = None) -> str | None:
    """The grammar constraining `body`'s output (None: unconstrained), checked; a
    GrammarError when it does not compile. `tool_grammar` is a forced tool call's."""
    if tool_grammar is not None:
        return _checked("tool_choice", tool_grammar)
    if body.structured_outputs is not None:
        return _checked("structured_outputs", _structured_outputs_grammar(body.structured_outputs))
    if body.response_format is not None:
        grammar = _response_format_grammar(body.response_format)
        return None if grammar is None else _checked("response_format", grammar)
    return None


def _response_format_grammar(response_format: ResponseFormat) -> str | None:
    if response_format.type == "json_object":
        return json_object_grammar()
    if response_format.type == "json_schema" and response_format.json_schema is not None:
        return _schema_grammar("response_format", response_format.json_schema.json_schema)
    return None


def _structured_outputs_grammar(params: StructuredOutputsParams) -> str:
    if params.json_ is not None:
        schema = params.json_
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise GrammarError("structured_outputs", f"json is not valid JSON: {exc}") from exc
            if not isinstance(schema, dict | bool):
                raise GrammarError("structured_outputs", "json must be a JSON schema object")
        return _schema_grammar("structured_outputs", schema)
    if params.regex is not None:
        return regex_grammar(params.regex)
    if params.choice is not None:
        return choice_grammar(params.choice)
    if params.grammar is not None:
        return lark_grammar(params.grammar)
    return json_object_grammar()


def _schema_grammar(param: str, schema: dict[str, object] | bool) -> str:
    try:
        return json_schema_grammar(schema)  # type: ignore[arg-type]
    except Exception as exc:  # NOTE: whatever the engine raises on odd input is a 400
        raise GrammarError(param, f"invalid JSON schema: {exc}") from exc


def _checked(param: str, grammar: str) -> str:
    try:
        check_grammar(grammar)
    except Exception as exc:  # ValueError, or anything the engine raises on odd input
        raise GrammarError(param, f"the engine cannot compile it: {exc}") from exc
    return grammar
