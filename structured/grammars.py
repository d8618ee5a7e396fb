"""Constraints as llguidance grammars: what the API process sends the engine core.

Every kind of structured output (a JSON schema, any JSON object, a regex, a choice of
strings, a Lark grammar, the tool-call formats of server/tool_parsers.py) becomes one
grammar string, compiled for the model's tokenizer (structured/compiler.py) by the API
process before the request is admitted and by the engine core; `check_grammar` validates
it first, without a tokenizer, so that a malformed grammar is a 400 that says why at once.
Both run under `PARSER_LIMITS`.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from llguidance import LLMatcher, LLParserLimits

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a stub-only TypedDict

# NOTE: compact JSON (no free whitespace): a small model allowed to write whitespace can
# spend its whole max_tokens on newlines inside an object.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}

# NOTE: llguidance's defaults let the first mask of `(a{1000}){1000}` take 2 s (1M of
# initial lexer fuel) and a grammar hold 250k lexer states (1-2 kB each); these bound a
# grammar's lexer to a fifth of that, far above what JSON schemas and tool calls use. A
# grammar over them fails to compile, or fails its request when a later mask needs more.
# Errors leave out the parser's state dump (they reach the client).
PARSER_LIMITS = LLParserLimits(
    initial_lexer_fuel=200_000, max_lexer_states=50_000, verbose_errors=False
)


def json_schema_grammar(schema: dict[str, Any] | bool) -> str:
    """A grammar for JSON values valid against `schema`."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    return str(LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))


def json_object_grammar() -> str:
    """OpenAI's JSON mode: any JSON object."""
    return json_schema_grammar({"type": "object"})


def regex_grammar(pattern: str) -> str:
    return str(LLMatcher.grammar_from_regex(pattern))


def choice_grammar(choices: list[str]) -> str:
    """Exactly one of `choices`."""
    return lark_grammar("start: " + " | ".join(lark_literal(c) for c in choices))


def lark_grammar(lark: str) -> str:
    """llguidance's Lark dialect (`%json {...}` embeds a JSON schema)."""
    return str(LLMatcher.grammar_from_lark(lark))


def lark_literal(text: str) -> str:
    """`text` as a Lark string literal (JSON's escapes)."""
    return json.dumps(text, ensure_ascii=False)


def lark_json(schema: dict[str, Any]) -> str:
    """`schema` embedded in a Lark grammar, compact like `json_schema_grammar`."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def check_grammar(grammar: str) -> None:
    """ValueError saying why, when the engine could not compile `grammar`."""
    error = LLMatcher.validate_grammar(grammar, limits=PARSER_LIMITS)
    if error:
        raise ValueError(error)
