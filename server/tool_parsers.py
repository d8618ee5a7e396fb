"""Tool calls in generated text (`--tool-call-parser`), and the grammars that force them.

A parser splits a choice's text into content and tool calls. `parse(text, final=False)`
reads a stream so far: text that may still turn into a call is left out of the content,
so that the content of a prefix is always a prefix of the final content (streams send
the difference). Output that does not parse as a call (bad JSON, an unknown shape) is
plain content, never an error. A call is a JSON object with a string `name` and its
arguments (the first `arguments` or `parameters` member: an object, or a string holding
one); the arguments are written canonically (server/json_stream.py). `stream()` gives a
choice's `ToolCallStream`, which reads the calls while they are generated: a call's name
once it is complete and its arguments have begun, and its arguments so far, each a
prefix of the finished call's. `forced_grammar` is what tool_choice "required" or a
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

from server.json_stream import JsonStream, canonical_json
from server.protocol import FunctionDefinition
from structured.grammars import lark_grammar, lark_json, lark_literal

# NOTE: a bound, so that a model sampling at a high temperature cannot call tools until
# max_tokens (a cut-off call would not parse).
MAX_PARALLEL_TOOL_CALLS = 8


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text of the arguments object (so far, in a stream)


class ToolCallStream(ABC):
    """One choice's tool calls while they are generated."""

    @abstractmethod
    def update(self, text: str) -> list[ParsedToolCall | None]:
        """Every call begun in the stream's text so far (`text` extends the previous
        one), in order: the call as far as it goes, or None while (or once) that text is
        no call."""


class ToolParser(ABC):
    """Content and tool calls of generated text, in one model family's format."""

    name: ClassVar[str]
    arguments_keys: ClassVar[tuple[str, ...]]

    @abstractmethod
    def parse(self, text: str, final: bool = True) -> tuple[str, list[ParsedToolCall]]:
        """(content, calls) of `text`; `final` False for a stream's text so far."""

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """A new reader of one stream's calls."""

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


def call_so_far(stream: JsonStream, arguments_keys: tuple[str, ...]) -> ParsedToolCall | None:
    """The call in the JSON object `stream` has read: once its name is complete and its
    arguments have begun, the name and the arguments so far (the whole call once the
    object is done); None while that is not yet known, or when it is no call."""
    output, members = stream.output, stream.members
    name = members.get("name")
    if stream.failed or name is None or name.end is None or output[name.start] != '"':
        return None
    key = next((k for k in members if k in arguments_keys), None)
    if key is None:
        return None
    member = members[key]
    value = output[member.start : member.end]
    if value.startswith("{"):
        arguments: str | None = value
    elif not value.startswith('"'):
        return None  # no object (or a number or literal not yet read)
    elif member.end is None:
        arguments = ""  # NOTE: arguments written as JSON text go out whole, once read
    else:
        arguments = canonical_json(json.loads(value))
        if arguments is None or not arguments.startswith("{"):
            return None
    return ParsedToolCall(json.loads(output[name.start : name.end]), arguments)


def _whole_call(body: str, arguments_keys: tuple[str, ...]) -> ParsedToolCall | None:
    """The call that `body` (one JSON object, whitespace around it) is, else None."""
    stream = JsonStream()
    stream.feed(body)
    if not stream.done or body[stream.num_read :].strip():
        return None
    return call_so_far(stream, arguments_keys)


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that starts `tag` (held back in a stream)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class HermesToolParser(ToolParser):
    name = "hermes"
    arguments_keys = ("arguments", "parameters")
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

    def _call(self, body: str) -> ParsedToolCall | None:
        return _whole_call(body, self.arguments_keys)

    def stream(self) -> ToolCallStream:
        return _HermesCallStream(self)

    def forced_grammar(self, tools: list[FunctionDefinition], parallel: bool) -> str:
        schema = lark_json(_tools_schema(tools, "arguments"))
        call = f"{lark_literal(self.START + chr(10))} {schema} {lark_literal(chr(10) + self.END)}"
        more = MAX_PARALLEL_TOOL_CALLS - 1
        start = f'start: call ("\\n" call)~0..{more}' if parallel else "start: call"
        return lark_grammar(f"{start}\ncall: {call}\n")


class _HermesCallStream(ToolCallStream):
    """Each `<tool_call>` block's JSON read as it grows (a possible end tag held back)."""

    def __init__(self, parser: HermesToolParser) -> None:
        self.parser = parser
        self._streams: list[JsonStream] = []
        self._num_fed: list[int] = []

    def update(self, text: str) -> list[ParsedToolCall | None]:
        parser = self.parser
        bodies: list[tuple[str, bool]] = []  # (body so far, whether the block is closed)
        position = 0
        for match in parser._BLOCK_RE.finditer(text):
            bodies.append((match.group(1), True))
            position = match.end()
        start = text.find(parser.START, position)
        if start != -1:
            body = text[start + len(parser.START) :]
            bodies.append((body[: len(body) - partial_tag_len(body, parser.END)], False))
        calls: list[ParsedToolCall | None] = []
        for k, (body, closed) in enumerate(bodies):
            if k == len(self._streams):
                self._streams.append(JsonStream())
                self._num_fed.append(0)
            stream = self._streams[k]
            stream.feed(body[self._num_fed[k] :])
            self._num_fed[k] = len(body)
            call = call_so_far(stream, parser.arguments_keys)
            if closed and (not stream.done or body[stream.num_read :].strip()):
                call = None
            calls.append(call)
        return calls


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    arguments_keys = ("parameters", "arguments")
    PYTHON_TAG = "<|python_tag|>"
    SEPARATORS = " \t\r\n;"

    def calls_text(self, text: str) -> str:
        """The text of the calls: the output less whitespace and a leading python tag."""
        body = text.strip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG) :].lstrip()
        return body

    def parse(self, text: str, final: bool = True) -> tuple[str, list[ParsedToolCall]]:
        body = self.calls_text(text)
        looks_like_call = body.startswith("{") or (
            not body or self.PYTHON_TAG.startswith(text.strip())
        )
        if not final:
            return ("", []) if looks_like_call else (text, [])
        calls = self._calls(body) if body.startswith("{") else None
        return ("", calls) if calls else (text, [])

    def _calls(self, body: str) -> list[ParsedToolCall] | None:
        calls, position = [], 0
        while position < len(body):
            stream = JsonStream()
            stream.feed(body[position:])
            call = call_so_far(stream, self.arguments_keys) if stream.done else None
            if call is None:
                return None
            calls.append(call)
            position += stream.num_read
            while position < len(body) and body[position] in self.SEPARATORS:
                position += 1
        return calls

    def stream(self) -> ToolCallStream:
        return _Llama3CallStream(self)

    def forced_grammar(self, tools: list[FunctionDefinition], parallel: bool) -> str:
        call = lark_json(_tools_schema(tools, "parameters"))
        more = MAX_PARALLEL_TOOL_CALLS - 1
        start = f'start: call ("; " call)~0..{more}' if parallel else "start: call"
        return lark_grammar(f"{start}\ncall: {call}\n")


class _Llama3CallStream(ToolCallStream):
    """The calls of the output read one after the other, `;` or whitespace between."""

    def __init__(self, parser: Llama3JsonToolParser) -> None:
        self.parser = parser
        self._calls: list[ParsedToolCall | None] = []
        self._stream: JsonStream | None = None  # the call being read
        self._start = 0  # where it starts in the calls text (or where the next may start)
        self._num_fed = 0
        self._broken = False

    def update(self, text: str) -> list[ParsedToolCall | None]:
        body = self.parser.calls_text(text)
        if not body.startswith("{"):
            return []
        while not self._broken:
            if self._stream is None:
                position = self._start
                while position < len(body) and body[position] in self.parser.SEPARATORS:
                    position += 1
                self._start = position
                if position == len(body):
                    break
                if body[position] != "{":
                    self._broken = True
                    break
                self._stream, self._num_fed = JsonStream(), position
                self._calls.append(None)
            stream = self._stream
            stream.feed(body[self._num_fed :])
            self._num_fed = len(body)
            self._calls[-1] = call_so_far(stream, self.parser.arguments_keys)
            self._broken = stream.failed
            if not stream.done:
                break
            self._start += stream.num_read
            self._stream = None
        return list(self._calls)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser)
}
