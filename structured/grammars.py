"""Constraints as llguidance grammars: what the API process sends the engine core.

Every kind of structured output (a JSON schema, any JSON object, a regex, a choice of
strings, a Lark grammar, the tool-call formats of server/tool_parsers.py) becomes one
grammar string, compiled for the model's tokenizer (structured/compiler.py) by the API
process before the request is admitted and by the engine core; `check_grammar` validates
it first, without a tokenizer, so that a malformed grammar is a 400 that says why at once.
Both run under `PARSER_LIMITS` and `MAX_FORCED_BYTES`, which bound what one grammar may
hold in memory; `grammar_cost` estimates it, the compiler's cache budget counts in it.
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
# initial lexer fuel) and a grammar hold 250k lexer states; these bound a grammar's first
# mask to a fifth of that time and its lexer to 10k states (~0.6 kB each, 6 MB), far above
# what JSON schemas and tool calls use. A grammar over them fails to compile, or fails its
# request when a later mask needs more. Errors leave out the parser's state dump (they
# reach the client).
PARSER_LIMITS = LLParserLimits(
    initial_lexer_fuel=200_000, max_lexer_states=10_000, verbose_errors=False
)

# NOTE: what a compiled grammar holds is mostly ~400 bytes of parser state per byte it
# forces before the model has a choice (`(a{1000}){1000}` forces 97,908 of them: 37 MB,
# within the fuel above), its lexer states and, for a large schema, ~120 bytes per byte of
# the grammar. A grammar forcing more than this fails to compile (6 MB at most).
MAX_FORCED_BYTES = 16 * 1024


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


def forced_bytes_error(num_forced: int) -> str | None:
    """Why a grammar that forces `num_forced` bytes at its start cannot be used (None: it
    can)."""
    if num_forced <= MAX_FORCED_BYTES:
        return None
    return (f"it forces {num_forced} bytes of output before the model has any choice, more "
            f"than the {MAX_FORCED_BYTES} a grammar may force (each is held in memory while "
            "the grammar is in use)")


# The cost model of `grammar_cost`, measured on the default model's tokenizer (49k tokens):
# llguidance builds what a grammar holds at ~200 MB per second of its compile's CPU time
# (lexer states, forced bytes alike), 390 bytes per forced byte, 120 per grammar byte.
BYTES_PER_COMPILE_CPU_S = 256 * 1024**2
BYTES_PER_FORCED_BYTE = 512
BYTES_PER_GRAMMAR_BYTE = 160


def grammar_cost(grammar: str, num_forced: int, compile_cpu_s: float) -> int:
    """An estimate (from above, within a small factor) of the memory a compiled grammar
    holds, from what its compile measured: its size, the bytes it forces at its start and
    the CPU time its compile and first mask took."""
    structural = BYTES_PER_GRAMMAR_BYTE * len(grammar) + BYTES_PER_FORCED_BYTE * num_forced
    return max(structural, int(BYTES_PER_COMPILE_CPU_S * compile_cpu_s))
