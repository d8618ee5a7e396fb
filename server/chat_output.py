"""A chat choice's text as OpenAI's message: reasoning, content and tool calls.

`ChatOutputParser.parse` reads a finished choice (non-streamed responses); `feed` reads a
stream's text deltas and returns what is new in each part: the parsers' streams (server/
reasoning.py, server/tool_parsers.py) read each delta once and keep their state, so a
delta costs what it adds, not what came before it. The last delta parses the whole text
as `parse` does and sends what is still missing of it, so the streamed parts reassemble
exactly to the parsed message (content that ends in whitespace is held back meanwhile:
it is dropped when it is all there is beside tool calls). A tool call goes out as OpenAI
streams it: a first delta (index, id, type, name, arguments "") once its name is
complete and its arguments have begun, then the fragments of its arguments as they are
generated (the first in the same chunk). NOTE: a call whose text breaks after its first
delta (bad JSON, cut off by max_tokens) cannot be taken back: the stream ends with what
was sent, and the text also goes out as content, which is what the whole response holds.
Whitespace-only content between tool calls is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server.reasoning import REASONING_PARSERS, Qwen3ReasoningParser
from server.requests import ChatCompletionRequest
from server.responses import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    random_id,
)
from server.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    ParsedToolCall,
    ToolCallDelta,
    ToolParser,
)


@dataclass
class ParsedChat:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


class ChatOutputParser:
    """Splits one choice's text; `tools` is None when no tool call is parsed."""

    def __init__(
        self,
        reasoning: Qwen3ReasoningParser | None,
        tools: ToolParser | None,
        parallel_tool_calls: bool = True,
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.parallel_tool_calls = parallel_tool_calls
        self._chunks: list[str] = []  # the stream's text
        self._reasoning_stream = reasoning.stream() if reasoning else None
        self._tool_stream = tools.stream() if tools else None
        self._num_reasoning_sent = 0
        self._num_answer_read = 0  # of the answer, by the tool stream
        self._num_content_sent = 0
        self._held_space: list[str] = []  # the content's trailing whitespace so far
        self._call_index: dict[int, int] = {}  # a call of the stream -> its tool call index
        self._num_calls_sent = 0

    def _parts(self, text: str) -> tuple[str, str, str, list[ParsedToolCall]]:
        """(reasoning, answer, content, calls): the answer is the text after reasoning, its
        content what is not a call."""
        reasoning, answer = "", text
        if self.reasoning is not None:
            reasoning, answer = self.reasoning.split(text)
        content, calls = answer, list[ParsedToolCall]()
        if self.tools is not None:
            content, calls = self.tools.parse(answer)
            if not self.parallel_tool_calls:
                calls = calls[:1]
        if calls and not content.strip():
            content = ""
        return reasoning, answer, content, calls

    def parse(self, text: str) -> ParsedChat:
        """The message of a finished choice."""
        reasoning, _, content, calls = self._parts(text)
        tool_calls = [_tool_call(c) for c in calls]
        return ParsedChat(
            reasoning=reasoning if self.reasoning is not None and reasoning else None,
            content=content if content or not tool_calls else None,
            tool_calls=tool_calls,
        )

    @property
    def called_tools(self) -> bool:
        """Whether the stream has sent a tool call."""
        return self._num_calls_sent > 0

    def feed(self, text: str, finished: bool) -> DeltaMessage:
        """The delta of a stream's next text (`finished`: the choice's last)."""
        self._chunks.append(text)
        if finished:
            reasoning, answer, content, _ = self._parts("".join(self._chunks))
            reasoning = reasoning[self._num_reasoning_sent :]
            answer = answer[self._num_answer_read :]
            content = content[self._num_content_sent :]
        else:
            reasoning, answer = (self._reasoning_stream.feed(text)
                                 if self._reasoning_stream is not None else ("", text))
        calls: list[ToolCallDelta] = []
        if self._tool_stream is not None:
            tool_content, calls = self._tool_stream.feed(answer)
            if not finished:
                content = self._hold_space(tool_content)
                if calls and (content or self._num_content_sent):
                    # the whitespace held after text goes out before the call, not after
                    # it (whitespace alone beside calls is no content: it stays held)
                    content += "".join(self._held_space)
                    self._held_space = []
        elif not finished:
            content = answer
        self._num_answer_read += len(answer)
        delta = DeltaMessage()
        if reasoning:
            delta.reasoning_content = reasoning
            self._num_reasoning_sent += len(reasoning)
        if content:
            delta.content = content
            self._num_content_sent += len(content)
        if self._tool_stream is not None:
            delta.tool_calls = self._tool_call_deltas(calls) or None
        return delta

    def _hold_space(self, content: str) -> str:
        """`content` less the whitespace it ends with, which goes out before what follows
        it."""
        kept = content.rstrip()
        if not kept:
            self._held_space.append(content)
            return ""
        out = "".join(self._held_space) + kept
        self._held_space = [content[len(kept) :]]
        return out

    def _tool_call_deltas(self, calls: list[ToolCallDelta]) -> list[DeltaToolCall]:
        """The first delta of each call that shows, and the new arguments of every call."""
        deltas = []
        for call in calls:
            index = self._call_index.get(call.index)
            if call.name is not None:
                if not self.parallel_tool_calls and self._num_calls_sent:
                    continue
                index = self._call_index[call.index] = self._num_calls_sent
                self._num_calls_sent += 1
                deltas.append(DeltaToolCall(
                    index=index, id=random_id("call"), type="function",
                    function=DeltaFunctionCall(name=call.name, arguments=""),
                ))
            if index is not None and call.arguments:
                deltas.append(DeltaToolCall(index=index,
                                            function=DeltaFunctionCall(arguments=call.arguments)))
        return deltas


def _tool_call(call: ParsedToolCall) -> ToolCall:
    return ToolCall(function=FunctionCall(name=call.name, arguments=call.arguments))


def tool_parser_for(body: ChatCompletionRequest, parser_name: str | None) -> ToolParser | None:
    """The parser of a request's tool calls (None: tool calls are not parsed). A forced
    call uses the configured format, hermes by default. ValueError for tool_choice auto
    without `--tool-call-parser`."""
    choice = body.effective_tool_choice
    if choice == "none":
        return None
    if parser_name is None:
        if choice == "auto":
            raise ValueError('tool_choice "auto" needs the server started with '
                             "--tool-call-parser (hermes or llama3_json)")
        return HermesToolParser()
    return TOOL_PARSERS[parser_name]()


def forced_tool_grammar(body: ChatCompletionRequest, parser: ToolParser | None) -> str | None:
    """The grammar of tool_choice "required" or a named function (else None)."""
    if not body.forces_tool_call or parser is None or not body.tools:
        return None
    choice = body.effective_tool_choice
    tools = [t.function for t in body.tools]
    if not isinstance(choice, str):
        tools = [t for t in tools if t.name == choice.function.name]
        return parser.forced_grammar(tools, parallel=False)
    return parser.forced_grammar(tools, parallel=body.parallel_tool_calls)


def chat_output_parser(
    body: ChatCompletionRequest, tool_parser: ToolParser | None, reasoning_name: str | None
) -> ChatOutputParser | None:
    """The parser of a request's choices (None: the text is all content)."""
    reasoning = REASONING_PARSERS[reasoning_name]() if reasoning_name is not None else None
    if reasoning is None and tool_parser is None:
        return None
    return ChatOutputParser(reasoning, tool_parser, body.parallel_tool_calls)
