"""Tool calls in generated text (`--tool-call-parser`), and the grammars that force them.

A parser splits a choice's text into content and tool calls (`parse`). Output that does
not parse as a call (bad JSON, an unknown shape) is plain content, never an error. A
call is a JSON object with a string `name` and its arguments (the first `arguments` or
`parameters` member: an object, or a string holding one); the arguments are written
canonically (server/json_stream.py). `stream()` gives a choice's `ToolCallStream`, which
reads the text as it is generated, each piece once (its work is linear in the text): the
content so far, less text that may still turn into a call (so that it is a prefix of the
final content), and each call once its name is complete and its arguments have begun,
then its arguments as they grow, a prefix of the finished call's. `forced_grammar` is
what tool_choice "required" or a named function constrains the output to: the parser's
own format with arguments valid against the function's parameters (closed: no
undeclared keys), at most MAX_PARALLEL_TOOL_CALLS calls, so the call always parses.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
  (Qwen2/Qwen3, Hermes), content around them.
- `llama3_json`: the whole output is `{"name": ..., "parameters": {...}}` (optionally
  after `<|python_tag|>`), several separated by `;`.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from itertools import islice
from typing import Any, ClassVar

from server.json_stream import JsonStream, Member, canonical_json
from server.requests import FunctionDefinition
from structured.grammars import lark_grammar, lark_json, lark_literal

# NOTE: a bound, so that a model sampling at a high temperature cannot call tools until
# max_tokens (a cut-off call would not parse).
MAX_PARALLEL_TOOL_CALLS = 8


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text of the arguments object (so far, in a stream)


@dataclass(frozen=True)
class ToolCallDelta:
    """What new text added to call number `index` of a stream (counted in the text, calls
    that turn out broken included): the name with the call's first delta, then the new
    text of its arguments."""

    index: int
    name: str | None
    arguments: str


class ToolCallStream(ABC):
    """One choice's content and tool calls while they are generated."""

    @abstractmethod
    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """(content, calls): what `text`, which follows the text fed before, adds to the
        content and to the calls."""


class ToolParser(ABC):
    """Content and tool calls of generated text, in one model family's format."""

    name: ClassVar[str]
    arguments_keys: ClassVar[tuple[str, ...]]

    @abstractmethod
    def parse(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        """(content, calls) of a choice's whole text."""

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """A new reader of one stream's text."""

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
        arguments = value
    elif not value.startswith('"'):
        return None  # no object (or a number or literal not yet read)
    elif member.end is None:
        arguments = ""  # NOTE: arguments written as JSON text go out whole, once read
    else:
        decoded = canonical_json(json.loads(value))
        if decoded is None or not decoded.startswith("{"):
            return None
        arguments = decoded
    return ParsedToolCall(json.loads(output[name.start : name.end]), arguments)


def _whole_call(body: str, arguments_keys: tuple[str, ...]) -> ParsedToolCall | None:
    """The call that `body` (one JSON object, whitespace around it) is, else None."""
    stream = JsonStream()
    stream.feed(body)
    if not stream.done or body[stream.num_read :].strip():
        return None
    return call_so_far(stream, arguments_keys)


class _CallReader:
    """One call's JSON object fed as it is generated; `delta()` is what the text fed since
    the last delta added to `call_so_far`'s call, at the cost of that news alone."""

    def __init__(self, index: int, arguments_keys: tuple[str, ...]) -> None:
        self.index = index
        self.json = JsonStream()
        self._keys = arguments_keys
        self._num_members = 0  # members looked at for the arguments
        self._arguments: Member | None = None
        self._name: str | None = None  # once the call shows
        self._num_sent = 0  # the output up to here went out as arguments
        self._dead = False  # not a call (any more)
        self.trailing_text = False  # text other than whitespace after the object

    def feed(self, text: str) -> int:
        """Read `text`; returns how much of it the JSON value took."""
        before = self.json.num_read
        if not self.json.done:
            self.json.feed(text)
        used = self.json.num_read - before
        if self.json.done and text[used:].strip():
            self.trailing_text = True
        return used

    def kill(self) -> None:
        """No more deltas: the call's text turned out to be no call."""
        self._dead = True

    def delta(self) -> ToolCallDelta | None:
        """The call's news since the last delta (None: none, or it is no call)."""
        self._dead = self._dead or self.json.failed
        if self._dead:
            return None
        first = self._name is None
        if first and not self._begin():
            return None
        arguments = self._new_arguments()
        if arguments is None:
            self._dead = True
            return None
        if not first and not arguments:
            return None
        return ToolCallDelta(self.index, self._name if first else None, arguments)

    def _begin(self) -> bool:
        """Whether the call shows: its name is a whole string and its arguments began with
        an object or a string."""
        json_stream = self.json
        name = json_stream.members.get("name")
        if name is None or name.end is None:
            return False
        if json_stream.text(name.start, name.start + 1) != '"':
            self._dead = True
            return False
        if self._arguments is None and not self._find_arguments():
            return False
        assert self._arguments is not None
        first = json_stream.text(self._arguments.start, self._arguments.start + 1)
        if first not in ("{", '"'):
            self._dead = bool(first)  # "": a number or literal not yet written
            return False
        self._name = json.loads(json_stream.text(name.start, name.end))
        self._num_sent = self._arguments.start
        return True

    def _find_arguments(self) -> bool:
        """The first arguments member (only the members new since the last look)."""
        members = self.json.members
        new = len(members) - self._num_members
        self._num_members = len(members)
        for key in reversed(list(islice(reversed(members), new))):
            if key in self._keys:
                self._arguments = members[key]
                return True
        return False

    def _new_arguments(self) -> str | None:
        """The arguments' text new since the last delta; None once they are no object."""
        json_stream, member = self.json, self._arguments
        assert member is not None
        end = json_stream.output_len if member.end is None else member.end
        if end == self._num_sent:
            return ""
        if json_stream.text(member.start, member.start + 1) == "{":
            new = json_stream.text(self._num_sent, end)
            self._num_sent = end
            return new
        if member.end is None:
            return ""  # NOTE: arguments written as JSON text go out whole, once read
        self._num_sent = end
        arguments = canonical_json(json.loads(json_stream.text(member.start, end)))
        return arguments if arguments is not None and arguments.startswith("{") else None


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

    def parse(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        position = 0
        while True:
            start = text.find(self.START, position)
            end = text.find(self.END, start + len(self.START)) if start != -1 else -1
            if end == -1:
                break
            call = self._call(text[start + len(self.START) : end])
            content.append(text[position:start])
            if call is None:
                content.append(text[start : end + len(self.END)])  # malformed: plain text
            else:
                calls.append(call)
            position = end + len(self.END)
        content.append(text[position:])
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
    """The text outside `<tool_call>` blocks is content, each block's JSON is read as it
    grows; a tail that may start a tag is held back. A closed block that is no call goes
    out as content."""

    def __init__(self, parser: HermesToolParser) -> None:
        self.parser = parser
        self._held = ""  # the start of a tag, perhaps
        self._block: _CallReader | None = None  # the open block's call
        self._body: list[str] = []  # the open block's text
        self._num_blocks = 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        start_tag, end_tag = self.parser.START, self.parser.END
        text, self._held = self._held + text, ""
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        position = 0
        while True:
            tag = start_tag if self._block is None else end_tag
            found = text.find(tag, position)
            piece = text[position:] if found == -1 else text[position:found]
            if found == -1:
                self._held = piece[len(piece) - partial_tag_len(piece, tag) :]
                piece = piece[: len(piece) - len(self._held)]
            if self._block is None:
                content.append(piece)
            else:
                self._read_body(piece, found != -1, content, calls)
            if found == -1:
                break
            if tag == start_tag:
                self._block = _CallReader(self._num_blocks, self.parser.arguments_keys)
                self._body = []
                self._num_blocks += 1
            position = found + len(tag)
        return "".join(content), calls

    def _read_body(self, piece: str, closed: bool, content: list[str],
                   calls: list[ToolCallDelta]) -> None:
        """Feed the open block `piece` of its body; `closed`: the body ends there."""
        block = self._block
        assert block is not None
        block.feed(piece)
        self._body.append(piece)
        if closed:
            self._block = None
            if not block.json.done or block.trailing_text or (
                call_so_far(block.json, self.parser.arguments_keys) is None
            ):
                block.kill()
                body = "".join(self._body)
                content.append(f"{self.parser.START}{body}{self.parser.END}")
        delta = block.delta()
        if delta is not None:
            calls.append(delta)


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

    def parse(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        body = self.calls_text(text)
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
    """Whether the output is calls is known from its first characters (less whitespace
    and the python tag): then the calls are read one after the other, `;` or whitespace
    between, trailing whitespace held back; else it is all content."""

    def __init__(self, parser: Llama3JsonToolParser) -> None:
        self.parser = parser
        self._is_calls: bool | None = None  # None: not known yet
        self._lead: list[str] = []  # the text while that is not known
        self._core: list[str] = []  # the same less leading whitespace
        self._held: list[str] = []  # trailing whitespace of the calls text
        self._reader: _CallReader | None = None  # the call being read
        self._num_calls = 0
        self._broken = False

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self._is_calls is None:
            body = self._decide(text)
            if self._is_calls is False:
                content, self._lead, self._core = "".join(self._lead), [], []
                return content, []
            if body is None:
                return "", []
            text = body
        elif not self._is_calls:
            return text, []
        kept = text.rstrip()
        if not kept:
            self._held.append(text)
            return "", []
        text, self._held = "".join(self._held) + kept, [text[len(kept) :]]
        return "", self._read_calls(text)

    def _decide(self, text: str) -> str | None:
        """Read `text` while it is not known whether the output is calls; once it is
        calls, the calls text so far."""
        self._lead.append(text)
        if self._core or text.strip():
            self._core.append(text if self._core else text.lstrip())
        if not text.strip():
            return None
        core = "".join(self._core)
        self._core = [core]
        # NOTE: a whitespace-less delta either decides or extends the tag (a few times)
        stripped, tag = core.rstrip(), self.parser.PYTHON_TAG
        has_tag = stripped.startswith(tag)
        body = stripped[len(tag) :].lstrip() if has_tag else stripped
        if body.startswith("{"):
            self._is_calls, self._lead, self._core = True, [], []
            return core[len(tag) :].lstrip() if has_tag else core
        if body and not tag.startswith(stripped):
            self._is_calls = False
        return None

    def _read_calls(self, text: str) -> list[ToolCallDelta]:
        calls: list[ToolCallDelta] = []
        position = 0
        while not self._broken:
            reader = self._reader
            if reader is None:
                while position < len(text) and text[position] in self.parser.SEPARATORS:
                    position += 1
                if position == len(text):
                    break
                if text[position] != "{":
                    self._broken = True
                    break
                reader = self._reader = _CallReader(self._num_calls, self.parser.arguments_keys)
                self._num_calls += 1
            position += reader.feed(text[position:])
            delta = reader.delta()
            if delta is not None:
                calls.append(delta)
            self._broken = reader.json.failed
            if not reader.json.done:
                break
            self._reader = None
        return calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser)
}
