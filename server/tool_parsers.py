"""Tool calls in generated text (`--tool-call-parser`), and the grammars that force them.

A parser splits a choice's text into content and tool calls. `parse(text, final=False)`
reads a stream so far: text that may still turn into a call is left out of the content,
so that the content of a prefix is always a prefix of the final content (streams send
the difference). Output that does not parse as a call (bad JSON, an unknown shape) is
plain content, never an error. `forced_grammar` is what tool_choice "required" or a
named function constrains the output to: the parser's own format with arguments valid
against the function's parameters (closed: no undeclared keys), at most
MAX_PARALLEL_TOOL_CALLS calls, so the call always parses.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
  (Qwen2/Qwen3, Hermes), content around them.
- `llama3_json`: the whole output is `{"name": ..., "parameters": {...}}` (optionally
  after `<|python_tag|>`), several separated by `;`.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from server.protocol import FunctionDefinition
from structured.grammars import lark_grammar, lark_json, lark_literal

# NOTE: a bound, so that a model sampling at a high temperature cannot call tools until
# max_tokens (a cut-off call would not parse).
MAX_PARALLEL_TOOL_CALLS = 8


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text of the arguments object


class ToolParser(ABC):
    """Content and tool calls of generated text, in one model family's format."""

    name: ClassVar[str]

    @abstractmethod
    def parse(self, text: str, final: bool = True) -> tuple[str, list[ParsedToolCall]]:
        """(content, calls) of `text`; `final` False for a stream's text so far."""

    @abstractmethod
    def forced_grammar(self, tools: list[FunctionDefinition], parallel: bool) -> str:
        """A grammar of one call (several with `parallel`) of one of `tools`."""


def closed_schema(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object that lists its
    properties and says nothing of others: a forced call has the declared arguments only
    (and a small model cannot invent keys until max_tokens)."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {k: closed_schema(v) for k, v in schema.items()}
    if "properties" in closed and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def _call_schema(tool: FunctionDefinition, arguments_key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name},
                       arguments_key: closed_schema(tool.parameters)},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def _tools_schema(tools: list[FunctionDefinition], arguments_key: str) -> dict[str, Any]:
    schemas = [_call_schema(t, arguments_key) for t in tools]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _as_call(data: Any, arguments_keys: tuple[str, ...]) -> ParsedToolCall | None:
    """A call from parsed JSON {"name": str, <arguments key>: object}, else None."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    for key in arguments_keys:
        arguments = data.get(key)
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if isinstance(arguments, dict):
            return ParsedToolCall(data["name"], json.dumps(arguments, ensure_ascii=False))
    return None


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that starts `tag` (held back in a stream)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str, final: bool = True) -> tuple[str, list[ParsedToolCall]]:
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        position = 0
        for match in self._BLOCK_RE.finditer(text):
            call = self._call(match.group(1))
            content.append(text[position : match.start()])
            if call is None:
                content.append(match.group(0))  # malformed: plain text
            else:
                calls.append(call)
            position = match.end()
        rest = text[position:]
        if not final:
            start = rest.find(self.START)
            if start != -1:
                rest = rest[:start]  # an open block: a call in the making
            else:
                rest = rest[: len(rest) - partial_tag_len(rest, self.START)]
        content.append(rest)
        return "".join(content), calls

    @staticmethod
    def _call(body: str) -> ParsedToolCall | None:
        try:
            data = json.loads(body)
        except ValueError:
            return None
        return _as_call(data, ("arguments", "parameters"))

    def forced_grammar(self, tools: list[FunctionDefinition], parallel: bool) -> str:
        schema = lark_json(_tools_schema(tools, "arguments"))
        call = f"{lark_literal(self.START + chr(10))} {schema} {lark_literal(chr(10) + self.END)}"
        more = MAX_PARALLEL_TOOL_CALLS - 1
        start = f'start: call ("\\n" call)~0..{more}' if parallel else "start: call"
        return lark_grammar(f"{start}\ncall: {call}\n")


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool = True) -> tuple[str, list[ParsedToolCall]]:
        body = text.strip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG) :].lstrip()
        looks_like_call = body.startswith("{") or (
            not body or self.PYTHON_TAG.startswith(text.strip())
        )
        if not final:
            return ("", []) if looks_like_call else (text, [])
        calls = self._calls(body) if body.startswith("{") else None
        return ("", calls) if calls else (text, [])

    @staticmethod
    def _calls(body: str) -> list[ParsedToolCall] | None:
        decoder = json.JSONDecoder()
        calls, position = [], 0
        while position < len(body):
            try:
                data, end = decoder.raw_decode(body, position)
            except ValueError:
                return None
            call = _as_call(data, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            position = end
            while position < len(body) and body[position] in " \t\r\n;":
                position += 1
        return calls

    def forced_grammar(self, tools: list[FunctionDefinition], parallel: bool) -> str:
        call = lark_json(_tools_schema(tools, "parameters"))
        more = MAX_PARALLEL_TOOL_CALLS - 1
        start = f'start: call ("; " call)~0..{more}' if parallel else "start: call"
        return lark_grammar(f"{start}\ncall: {call}\n")


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser)
}
