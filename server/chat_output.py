"""A chat choice's text as OpenAI's message: reasoning, content and tool calls.

`ChatOutputParser.parse` reads a finished choice (non-streamed responses); `feed` reads a
stream's text deltas and returns what is new in each part: the parsers (server/
reasoning.py, server/tool_parsers.py) are run on the text so far, and the difference to
what was sent is the delta, so the streamed parts reassemble exactly to the parsed
message. A tool call goes out as OpenAI streams it: a first delta (index, id, type, name,
arguments "") once its name is complete and its arguments have begun, then the fragments
of its arguments as they are generated (the first in the same chunk). NOTE: a call
whose text breaks after its first delta (bad JSON, cut off by max_tokens) cannot be
taken back: the stream ends with what was sent, and the text also goes out as content,
which is what the whole response holds.
Whitespace-only content between tool calls is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from server.reasoning import REASONING_PARSERS, Qwen3ReasoningParser
from server.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    ParsedToolCall,
    ToolCallStream,
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
        self._text = ""
        self._num_reasoning_sent = 0
        self._num_content_sent = 0
        self._call_stream: ToolCallStream | None = tools.stream() if tools else None
        self._call_index: dict[int, int] = {}  # a call of the stream -> its tool call index
        self._num_arguments_sent: list[int] = []

    def _parts(self, text: str, final: bool) -> tuple[str, str, str, list[ParsedToolCall]]:
        """(reasoning, answer, content, calls): the answer is the text after reasoning, its
        content what is not a call."""
        reasoning, answer = "", text
        if self.reasoning is not None:
            reasoning, answer = self.reasoning.split(text, final)
        content, calls = answer, []
        if self.tools is not None:
            content, calls = self.tools.parse(answer, final)
            if not self.parallel_tool_calls:
                calls = calls[:1]
        if calls and not content.strip():
            content = ""
        return reasoning, answer, content, calls

    def parse(self, text: str) -> ParsedChat:
        """The message of a finished choice."""
        reasoning, _, content, calls = self._parts(text, final=True)
        tool_calls = [_tool_call(c) for c in calls]
        return ParsedChat(
            reasoning=reasoning if self.reasoning is not None and reasoning else None,
            content=content if content or not tool_calls else None,
            tool_calls=tool_calls,
        )

    @property
    def called_tools(self) -> bool:
        """Whether the stream has sent a tool call."""
        return bool(self._num_arguments_sent)

    def feed(self, text: str, finished: bool) -> DeltaMessage:
        """The delta of a stream's next text (`finished`: the choice's last)."""
        self._text += text
        reasoning, answer, content, calls = self._parts(self._text, final=finished)
        if not finished:
            content = content.rstrip() if calls or self.tools is not None else content
        delta = DeltaMessage()
        if len(reasoning) > self._num_reasoning_sent:
            delta.reasoning_content = reasoning[self._num_reasoning_sent :]
            self._num_reasoning_sent = len(reasoning)
        if len(content) > self._num_content_sent:
            delta.content = content[self._num_content_sent :]
            self._num_content_sent = len(content)
        if self._call_stream is not None:
            delta.tool_calls = self._tool_call_deltas(self._call_stream.update(answer)) or None
        return delta

    def _tool_call_deltas(self, calls: list[ParsedToolCall | None]) -> list[DeltaToolCall]:
        """The first delta of each call whose name is new, and the new arguments of every
        call."""
        deltas = []
        for k, call in enumerate(calls):
            if call is None:
                continue
            index = self._call_index.get(k)
            if index is None:
                if not self.parallel_tool_calls and self._num_arguments_sent:
                    continue
                index = self._call_index[k] = len(self._num_arguments_sent)
                self._num_arguments_sent.append(0)
                deltas.append(DeltaToolCall(
                    index=index, id=_tool_call(call).id, type="function",
                    function=DeltaFunctionCall(name=call.name, arguments=""),
                ))
            new = call.arguments[self._num_arguments_sent[index] :]
            if new:
                self._num_arguments_sent[index] = len(call.arguments)
                deltas.append(DeltaToolCall(index=index,
                                            function=DeltaFunctionCall(arguments=new)))
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
