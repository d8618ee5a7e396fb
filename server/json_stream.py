"""An incremental JSON reader: the text of one value, a piece at a time, written out
canonically as soon as nothing can change it any more.

The output is what `json.dumps(json.loads(text), ensure_ascii=False)` writes (", " and
": " between items, no other whitespace, strings and numbers re-encoded), except that
duplicate keys are all kept. A string goes out character by character as it arrives (an
escape once complete, a surrogate pair once both halves are in), a number or a literal
once it ends, punctuation at once; so the output so far is always a prefix of the final
output. That is what lets a streamed tool call send its arguments as they are generated
and still reassemble to exactly the non-streamed call's arguments.

The members of a top-level object are recorded as spans of the output (the first of
duplicate keys), so that a call's name and arguments can be read while it streams. Each
character fed is read once, and `text(start)` costs what it returns: a stream's work is
linear in its text however finely it is fed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WHITESPACE = " \t\n\r"
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_NUMBER_RE = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_LITERALS = ("true", "false", "null")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
            "t": "\t"}


@dataclass
class Member:
    """A top-level object member: its value is `output[start:end]` (`end` None while the
    value is still being read)."""

    start: int
    end: int | None = None


class JsonStream:
    """Reads one JSON value with `feed`; `output` is its canonical text so far.

    `done` once the value is complete (`num_read` is then the offset just past it in the
    text fed, and later text is not read); `failed` once the text cannot be JSON (nothing
    more is read). `members` holds the spans of a top-level object's members, by key.
    """

    def __init__(self) -> None:
        self.done = False
        self.failed = False
        self.num_read = 0
        self.members: dict[str, Member] = {}
        self._out: list[str] = []  # NOTE: one character a slot, so that a span is cheap
        self._stack: list[str] = []  # "{" or "[" of each open container
        # what comes next: value, value_or_close, key, key_or_close, colon, comma_or_close
        self._expect = "value"
        self._token: list[str] | None = None  # a number or literal being read
        self._in_string = False
        self._is_key = False
        self._key: list[str] = []  # a top-level key's characters
        self._escape: str | None = None  # "" after a backslash, "u..." inside \uXXXX
        self._high_surrogate: int | None = None
        self._member_key: str | None = None
        self._member: Member | None = None

    @property
    def output(self) -> str:
        """The canonical text of what has been read so far."""
        return "".join(self._out)

    @property
    def output_len(self) -> int:
        return len(self._out)

    def text(self, start: int, end: int | None = None) -> str:
        """`output[start:end]`, at the cost of the span alone."""
        return "".join(self._out[start:end])

    def feed(self, text: str) -> None:
        """Read `text`, which follows what was fed before."""
        for char in text:
            if self.done or self.failed:
                return
            self._read(char)
            if not self.done:
                self.num_read += 1

    # ---- internals

    def _emit(self, text: str) -> None:
        self._out.extend(text)

    def _fail(self) -> None:
        self.failed = True

    def _read(self, char: str) -> None:
        if self._in_string:
            self._string_char(char)
            return
        if self._token is not None:
            if self._token_char(char):
                return
            if self.done or self.failed:
                return
        if char in _WHITESPACE:
            return
        expect = self._expect
        if expect in ("value", "value_or_close"):
            if char == "]" and expect == "value_or_close":
                self._close("[")
            else:
                self._start_value(char)
        elif expect in ("key", "key_or_close"):
            if char == '"':
                self._start_string(is_key=True)
            elif char == "}" and expect == "key_or_close":
                self._close("{")
            else:
                self._fail()
        elif expect == "colon":
            if char == ":":
                self._emit(": ")
                self._expect = "value"
            else:
                self._fail()
        elif expect == "comma_or_close":
            if char == ",":
                self._emit(", ")
                self._expect = "key" if self._stack[-1] == "{" else "value"
            elif char in "}]":
                self._close("{" if char == "}" else "[")
            else:
                self._fail()

    def _start_value(self, char: str) -> None:
        if self._stack == ["{"]:
            self._member = Member(len(self._out))
            assert self._member_key is not None
            self.members.setdefault(self._member_key, self._member)
        if char in "{[":
            self._stack.append(char)
            self._emit(char)
            self._expect = "key_or_close" if char == "{" else "value_or_close"
        elif char == '"':
            self._start_string(is_key=False)
        elif char == "-" or char.isdigit() or char in "tfn":
            self._token = [char]
        else:
            self._fail()

    def _token_char(self, char: str) -> bool:
        """Read `char` into the number or literal under way; False when it ends it (the
        token is then emitted, or the stream failed)."""
        token = self._token
        assert token is not None
        is_number = token[0] not in "tfn"
        if (char in _NUMBER_CHARS) if is_number else char.isalpha():
            token.append(char)
            if not is_number and not any(lit.startswith("".join(token)) for lit in _LITERALS):
                self._fail()
            return True
        self._token = None
        text = "".join(token)
        if is_number and _NUMBER_RE.fullmatch(text):
            self._emit(json.dumps(json.loads(text)))
        elif text in _LITERALS:
            self._emit(text)
        else:
            self._fail()
            return False
        self._value_done(ends_here=False)
        return False

    def _start_string(self, is_key: bool) -> None:
        self._in_string, self._is_key = True, is_key
        self._key = []
        self._emit('"')

    def _string_char(self, char: str) -> None:
        escape = self._escape
        if escape is None:
            if char == '"':
                self._flush_surrogate()
                self._in_string = False
                self._emit('"')
                self._string_done()
            elif char == "\\":
                self._escape = ""
            elif ord(char) < 0x20:  # json.loads (strict) refuses raw control characters
                self._fail()
            else:
                self._char_out(char)
        elif escape == "":
            if char == "u":
                self._escape = "u"
            elif char in _ESCAPES:
                self._escape = None
                self._char_out(_ESCAPES[char])
            else:
                self._fail()
        elif char in "0123456789abcdefABCDEF":
            escape += char
            self._escape = escape
            if len(escape) == 5:
                self._escape = None
                self._code_point(int(escape[1:], 16))
        else:
            self._fail()

    def _code_point(self, code: int) -> None:
        """A \\uXXXX escape: a high surrogate waits for its low half."""
        high = self._high_surrogate
        if high is not None and 0xDC00 <= code <= 0xDFFF:
            self._high_surrogate = None
            self._put(chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00)))
            return
        self._flush_surrogate()
        if 0xD800 <= code <= 0xDBFF:
            self._high_surrogate = code
        else:
            self._put(chr(code))

    def _char_out(self, char: str) -> None:
        self._flush_surrogate()
        self._put(char)

    def _flush_surrogate(self) -> None:
        if self._high_surrogate is not None:
            self._put(chr(self._high_surrogate))  # a lone half, as json.loads keeps it
            self._high_surrogate = None

    def _put(self, char: str) -> None:
        if self._is_key and self._stack == ["{"]:
            self._key.append(char)
        self._emit(json.dumps(char, ensure_ascii=False)[1:-1])

    def _string_done(self) -> None:
        if self._is_key:
            if self._stack == ["{"]:
                self._member_key = "".join(self._key)
            self._expect = "colon"
        else:
            self._value_done()

    def _close(self, opener: str) -> None:
        if self._stack[-1] != opener:
            self._fail()
            return
        self._stack.pop()
        self._emit("}" if opener == "{" else "]")
        self._value_done()

    def _value_done(self, ends_here: bool = True) -> None:
        """A value ended: with the current character, or (a number or literal) just
        before it."""
        if not self._stack:
            self.done = True
            self.num_read += ends_here
            return
        self._expect = "comma_or_close"
        if len(self._stack) == 1 and self._member is not None:
            self._member.end = len(self._out)
            self._member = None


def canonical_json(text: str) -> str | None:
    """The canonical text of `text` if it is one JSON value (whitespace around it
    allowed), else None."""
    stream = JsonStream()
    stream.feed(text)
    stream.feed(" ")  # ends a number or literal at the very end
    if not stream.done or text[stream.num_read :].strip(_WHITESPACE):
        return None
    return stream.output
