"""Tool-call and reasoning parsers: complete and streamed output, malformed output as
plain content, and the forced-call grammars (every output they allow parses)."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llguidance import LLMatcher

from server import json_stream, tool_parsers
from server.chat_output import ChatOutputParser, chat_output_parser, tool_parser_for
from server.reasoning import Qwen3ReasoningParser, ReasoningStream
from server.requests import ChatCompletionRequest, FunctionDefinition
from server.responses import DeltaMessage
from server.tool_parsers import HermesToolParser, Llama3JsonToolParser, closed_schema
from tests.support.structured_helpers import allowed_tokens, byte_ll_tokenizer

WEATHER = FunctionDefinition(name="get_weather", parameters={
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
})
ADD = FunctionDefinition(name="add", parameters={
    "type": "object",
    "properties": {"a": {"type": "integer", "maximum": 99, "minimum": 0},
                   "b": {"type": "integer", "maximum": 99, "minimum": 0}},
    "required": ["a", "b"],
})


def _hermes_block(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


# ------------------------------------------------------------------ complete output


def test_hermes_parses_calls_and_keeps_content() -> None:
    text = "Let me check.\n" + _hermes_block("get_weather", {"city": "Paris", "unit": "c"}) \
        + "\n" + _hermes_block("add", {"a": 1, "b": 2})
    content, calls = HermesToolParser().parse(text)
    assert content == "Let me check.\n\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": 2})]


@pytest.mark.parametrize("text", [
    "<tool_call>{not json}</tool_call>",
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    '<tool_call>["a list"]</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": 1}',  # cut off
    "plain text, no call at all",
    "",
])
def test_hermes_malformed_output_is_plain_content(text: str) -> None:
    content, calls = HermesToolParser().parse(text)
    assert calls == [] and content == text


def test_llama3_json_parses_one_or_several_calls() -> None:
    parser = Llama3JsonToolParser()
    content, calls = parser.parse('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}')
    assert content == "" and calls[0].name == "add"
    content, calls = parser.parse(
        '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", '
        '"parameters": {"city": "Oslo", "unit": "c"}}')
    assert [c.name for c in calls] == ["add", "get_weather"]


@pytest.mark.parametrize("text", ['{"name": "add"}', "{broken", "Hello there", '{"a": 1} and'])
def test_llama3_json_malformed_output_is_plain_content(text: str) -> None:
    assert Llama3JsonToolParser().parse(text) == (text, [])


def test_qwen3_reasoning_split() -> None:
    parser = Qwen3ReasoningParser()
    assert parser.split("<think>\nhmm, 2+2\n</think>\n\nIt is 4.") == ("\nhmm, 2+2\n", "It is 4.")
    assert parser.split("No thinking here.") == ("", "No thinking here.")
    assert parser.split("<think>cut off") == ("cut off", "")


# ------------------------------------------------------------------ streams


def _stream(parser: ChatOutputParser, text: str, rng: random.Random) -> list[DeltaMessage]:
    deltas, position = [], 0
    while position < len(text):
        step = rng.randint(1, 6)
        piece, position = text[position : position + step], position + step
        deltas.append(parser.feed(piece, finished=position >= len(text)))
    if not text:
        deltas.append(parser.feed("", finished=True))
    return deltas


def _reassemble(deltas: list[DeltaMessage]) -> tuple[str, str, list[tuple[str, str]]]:
    reasoning = "".join(d.reasoning_content or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for call in d.tool_calls or ():
            entry = calls.setdefault(call.index, ["", ""])
            entry[0] += call.function.name or ""
            entry[1] += call.function.arguments or ""
    return reasoning, content, [tuple(calls[i]) for i in sorted(calls)]


STREAM_CASES = [
    ("hermes", None, "Sure.\n" + _hermes_block("add", {"a": 1, "b": 2}) + "\nDone."),
    ("hermes", None, _hermes_block("add", {"a": 1, "b": 2}) + "\n"
     + _hermes_block("get_weather", {"city": "Rome", "unit": "f"})),
    ("hermes", None, "a < b but <tool_call>{oops}</tool_call> and <tool_"),
    ("hermes", "qwen3", "<think>plan: call add</think>\n" + _hermes_block("add", {"a": 5, "b": 6})),
    ("llama3_json", None, '{"name": "add", "parameters": {"a": 1, "b": 2}}'),
    ("llama3_json", None, "{not a call"),
    ("llama3_json", None, "Just words."),
    (None, "qwen3", "<think>deep thought</think>\n\n42"),
    (None, "qwen3", "<thi"),
    ("hermes", None, ""),
    # pretty-printed, escapes, a surrogate pair, exponent and negative numbers, nesting
    ("hermes", None, '<tool_call>\n{"name": "get_weather",\n "arguments": {\n  "city": '
     '"S\\u00e3o \\ud83d\\ude00 \\"P\\"\\n",\n  "n": 1E2, "m": -0.50, '
     '"xs": [1, true, null, {}, []]}}\n</tool_call>'),
    ("hermes", None, '<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call>'),
    ("hermes", None, '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'),
    ("hermes", None, '<tool_call>{"name": "add", "parameters": {"a": [1]}}</tool_call> ok'),
    ("hermes", None, '<tool_call>{"name": "add", "arguments": [1]}</tool_call>'),
    ("llama3_json", None, '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; '
     '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}'),
]


@pytest.mark.parametrize("tool_name, reasoning_name, text", STREAM_CASES)
@pytest.mark.parametrize("seed", range(5))
def test_streamed_deltas_reassemble_to_the_complete_parse(
    tool_name: str | None, reasoning_name: str | None, text: str, seed: int
) -> None:
    def make() -> ChatOutputParser:
        tools = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}
        return ChatOutputParser(
            Qwen3ReasoningParser() if reasoning_name else None,
            tools[tool_name]() if tool_name else None,
        )

    parsed = make().parse(text)
    reasoning, content, calls = _reassemble(_stream(make(), text, random.Random(seed)))
    assert reasoning == (parsed.reasoning or "")
    assert content == (parsed.content or "")
    assert calls == [(c.function.name, c.function.arguments) for c in parsed.tool_calls]


def _char_by_char(parser: ChatOutputParser, text: str) -> list[DeltaMessage]:
    return [parser.feed(char, finished=i == len(text) - 1) for i, char in enumerate(text)]


@pytest.mark.parametrize("parser, text, arguments", [
    (HermesToolParser(), "Let me see. " + _hermes_block("get_weather", {"city": "Paris"}),
     {"city": "Paris"}),
    (Llama3JsonToolParser(), '{"name": "get_weather", "parameters": {"city": "Paris"}}',
     {"city": "Paris"}),
])
def test_tool_call_arguments_stream_as_they_are_generated(parser, text, arguments) -> None:
    """A first delta once the name is known and the arguments begin, then fragments of
    the arguments, all out before the call's text ends."""
    deltas = _char_by_char(ChatOutputParser(None, parser), text)
    pieces = [(i, call) for i, d in enumerate(deltas) for call in d.tool_calls or ()]
    (at, first), rest = pieces[0], pieces[1:]
    assert text[: at + 1].endswith('"get_weather", "' + parser.arguments_keys[0] + '": {')
    assert first.id and first.type == "function"
    assert (first.function.name, first.function.arguments) == ("get_weather", "")
    assert len(rest) >= 8 and all(c.id is None and c.function.name is None for _, c in rest)
    assert pieces[-1][0] <= text.rindex("}")
    assert "".join(c.function.arguments for _, c in rest) == json.dumps(arguments)


@pytest.mark.parametrize("tool_name, text", [
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1}'),  # cut off
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1}} oops</tool_call>'),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1,, }}</tool_call>'),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1}} and more'),
])
def test_a_call_broken_after_its_first_delta_ends_as_content_too(tool_name, text) -> None:
    """What was sent of the call stays sent; the text goes out as content, which is what
    the whole response holds."""
    def make() -> ChatOutputParser:
        return ChatOutputParser(None, {"hermes": HermesToolParser,
                                       "llama3_json": Llama3JsonToolParser}[tool_name]())

    parsed = make().parse(text)
    assert parsed.tool_calls == [] and parsed.content == text
    _, content, calls = _reassemble(_char_by_char(make(), text))
    assert content == text and [name for name, _ in calls] == ["add"]


def test_content_held_back_goes_out_before_the_call_that_follows_it() -> None:
    """Text then a call in two chunks: the text's trailing space, held in case more text
    follows, goes out with the call, never after it (the Responses API would make it a
    message item of its own after the call)."""
    parser = ChatOutputParser(Qwen3ReasoningParser(), HermesToolParser())
    deltas = [parser.feed("<think>hmm</think>Sure. ", False),
              parser.feed('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', False),
              parser.feed("", True)]
    first_call = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert "".join(d.content or "" for d in deltas[: first_call + 1]) == "Sure. "
    assert not any(d.content for d in deltas[first_call + 1 :])


_WORDS = ["Sure.", " ", "\n", "\n\n", "a < b", "<tool", "<think", "é😀", "{", "tool_call>", "x"]
_ARGUMENTS = st.recursive(
    st.one_of(st.integers(-10**6, 10**6), st.booleans(), st.none(), st.floats(allow_nan=False,
              allow_infinity=False), st.text(alphabet='ab"\\\n é😀<>{}', max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text("kéy", max_size=3), inner, max_size=3)),
    max_leaves=8,
)


@st.composite
def _chat_texts(draw) -> tuple[str, str | None, bool, str]:
    """(tool parser, reasoning parser, parallel, text): well-formed calls among content."""
    tool_name = draw(st.sampled_from(["hermes", "llama3_json", None]))
    reasoning = draw(st.sampled_from(["qwen3", None] if tool_name else ["qwen3"]))
    calls = [json.dumps({"name": draw(st.sampled_from(["add", "get_weather"])),
                         ("parameters" if tool_name == "llama3_json" else "arguments"):
                         draw(st.dictionaries(st.text("ab", max_size=2), _ARGUMENTS, max_size=3))},
                        ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 1])))
             for _ in range(draw(st.integers(0, 3)))]
    words = st.lists(st.sampled_from(_WORDS), max_size=4).map("".join)
    if tool_name == "llama3_json" and calls:
        answer = draw(st.sampled_from(["", "<|python_tag|>", " "])) + "; ".join(calls)
    elif tool_name == "hermes":
        answer = draw(words) + "".join(f"<tool_call>{c}</tool_call>" + draw(words) for c in calls)
    else:
        answer = draw(words)
    if reasoning and draw(st.booleans()):
        answer = f"<think>{draw(words)}</think>{draw(st.sampled_from(['', chr(10)]))}{answer}"
    return tool_name, reasoning, draw(st.booleans()), answer


@settings(max_examples=150, deadline=None, derandomize=True)
@given(case=_chat_texts(), cuts=st.lists(st.integers(0, 400), max_size=40))
def test_deltas_on_any_split_reassemble_to_the_complete_parse(case, cuts) -> None:
    tool_name, reasoning_name, parallel, text = case

    def make() -> ChatOutputParser:
        tools = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}
        return ChatOutputParser(Qwen3ReasoningParser() if reasoning_name else None,
                                tools[tool_name]() if tool_name else None, parallel)

    parsed, parser = make().parse(text), make()
    ends = sorted({c for c in cuts if 0 < c < len(text)} | {len(text)})
    deltas = [parser.feed(text[start:end], finished=end == len(text))
              for start, end in zip([0, *ends], ends, strict=False)]
    reasoning, content, calls = _reassemble(deltas)
    assert reasoning == (parsed.reasoning or "")
    assert content == (parsed.content or "")
    assert calls == [(c.function.name, c.function.arguments) for c in parsed.tool_calls]


class _Reads:
    """Counts the characters handed to every reader of a stream's text: the parsers'
    streams and the JSON reader take each piece, `parse`/`split` a whole text."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.chars = 0
        for owner, name in [(tool_parsers._HermesCallStream, "feed"),
                            (tool_parsers._Llama3CallStream, "feed"), (ReasoningStream, "feed"),
                            (json_stream.JsonStream, "feed"), (HermesToolParser, "parse"),
                            (Llama3JsonToolParser, "parse"), (Qwen3ReasoningParser, "split")]:
            monkeypatch.setattr(owner, name, self._counting(getattr(owner, name)))
        text = json_stream.JsonStream.text
        monkeypatch.setattr(json_stream.JsonStream, "text", lambda s, *a: self._count(text(s, *a)))

    def _count(self, text: str) -> str:
        self.chars += len(text)
        return text

    def _counting(self, method):
        def counted(obj, text: str, *args):
            self._count(text)
            return method(obj, text, *args)
        return counted


@pytest.mark.parametrize("tool_name, reasoning_name", [
    ("hermes", "qwen3"), ("llama3_json", None), (None, "qwen3")])
def test_a_stream_reads_each_delta_once_however_many_deltas(
        monkeypatch, tool_name, reasoning_name) -> None:
    """The characters read for a stream are a few times its length, whether it comes in
    a thousand deltas or in four thousand (re-reading the text so far would read ~n^2/2
    of them: four times as many for four times the deltas)."""
    arguments = json.dumps({f"k{i}": ["v", i, {"s": "é\n"}] for i in range(250)})
    call = {"hermes": f'<tool_call>{{"name": "add", "arguments": {arguments}}}</tool_call>',
            "llama3_json": f'{{"name": "add", "parameters": {arguments}}}', None: ""}[tool_name]
    thought = "<think>" + "let me think. " * 300 + "</think>\n" if reasoning_name else ""
    text = thought + ("Sure.  " * 100 if tool_name != "llama3_json" else "") + call
    assert len(text) >= 4000
    tools = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}
    reads = _Reads(monkeypatch)
    work = {}
    for size in (4, 1):
        parser = ChatOutputParser(Qwen3ReasoningParser() if reasoning_name else None,
                                  tools[tool_name]() if tool_name else None)
        reads.chars = 0
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        deltas = [parser.feed(p, finished=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        expected = json.dumps(json.loads(arguments), ensure_ascii=False)
        assert _reassemble(deltas)[2] == ([("add", expected)] if tool_name else [])
        work[size] = reads.chars
    assert work[1] <= 1.25 * work[4], work
    assert work[1] <= 8 * len(text), work


# ------------------------------------------------------------------ forced calls


def _chat(**fields) -> ChatCompletionRequest:
    tools = [{"type": "function", "function": f.model_dump()} for f in (WEATHER, ADD)]
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": tools, **fields})


def test_auto_needs_a_configured_parser_but_forced_calls_do_not() -> None:
    with pytest.raises(ValueError, match="--tool-call-parser"):
        tool_parser_for(_chat(), None)
    assert isinstance(tool_parser_for(_chat(tool_choice="required"), None), HermesToolParser)
    assert tool_parser_for(_chat(tool_choice="none"), None) is None
    assert chat_output_parser(_chat(tool_choice="none"), None, None) is None


def test_named_tool_choice_must_be_declared() -> None:
    import pydantic

    with pytest.raises(pydantic.ValidationError, match="not in tools"):
        _chat(tool_choice={"type": "function", "function": {"name": "nope"}})


def test_closed_schema_closes_every_object() -> None:
    closed = closed_schema({"type": "object", "properties": {
        "inner": {"type": "object", "properties": {"x": {"type": "integer"}}}}})
    assert closed["additionalProperties"] is False
    assert closed["properties"]["inner"]["additionalProperties"] is False


@pytest.mark.parametrize("parser", [HermesToolParser(), Llama3JsonToolParser()])
@pytest.mark.parametrize("parallel", [False, True])
def test_forced_grammars_only_allow_calls_that_parse(parser, parallel: bool) -> None:
    tokenizer = byte_ll_tokenizer()
    grammar = parser.forced_grammar([WEATHER, ADD], parallel)
    assert LLMatcher.validate_grammar(grammar) == ""
    import numpy as np

    rng = random.Random(1)
    for _ in range(5):
        matcher = LLMatcher(tokenizer, grammar)
        out = bytearray()
        bitmask = np.zeros((1, 9), dtype=np.int32)
        while not matcher.is_stopped() and len(out) < 400:
            matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
            allowed = allowed_tokens(bitmask, 0)
            # NOTE: prefer ending when allowed, so that random walks stay short
            token = 256 if 256 in allowed and rng.random() < 0.5 else rng.choice(allowed)
            assert matcher.consume_token(token)
            if token < 256:
                out.append(token)
        content, calls = parser.parse(out.decode())
        assert calls and not content.strip(), out.decode()
        for call in calls:
            assert call.name in ("get_weather", "add")
            arguments = json.loads(call.arguments)
            assert set(arguments) == ({"city", "unit"} if call.name == "get_weather"
                                      else {"a", "b"})
