"""Reasoning text split from the answer (`--reasoning-parser`).

`qwen3`: output that starts with `<think>` is reasoning up to `</think>`, the rest is the
answer; output without it is all answer (Qwen3 with `enable_thinking` off gets an empty
think block in its prompt). `split` reads a whole text; `stream()` reads a stream's text
as it is generated, each piece once, and holds back what may still be the start of
`<think>` or of `</think>`, so that its parts so far are prefixes of the final parts.
"""

from __future__ import annotations

from typing import ClassVar

from server.tool_parsers import partial_tag_len


class Qwen3ReasoningParser:
    name: ClassVar[str] = "qwen3"
    START, END = "<think>", "</think>"

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) of `text`."""
        stripped = text.lstrip()
        if not stripped.startswith(self.START):
            return "", text
        body = stripped[len(self.START) :]
        end = body.find(self.END)
        if end == -1:
            return body, ""  # cut off while thinking
        return body[:end], body[end + len(self.END) :].lstrip("\n")

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


class ReasoningStream:
    """One stream's text split as it comes: before `<think>` is known or not, in the
    reasoning, then in the answer (whose leading newlines are dropped after reasoning)."""

    def __init__(self, parser: Qwen3ReasoningParser) -> None:
        self.parser = parser
        self._state = "lead"  # lead, reasoning or answer
        self._lead: list[str] = []  # the text while it may still begin with <think>
        self._core = ""  # the same less leading whitespace: a start of <think>
        self._held = ""  # the start of </think>, perhaps
        self._strip_newlines = False

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer): what `text`, which follows the text fed before, adds to
        each."""
        start, end_tag = self.parser.START, self.parser.END
        if self._state == "lead":
            self._lead.append(text)
            core = self._core + text if self._core else text.lstrip()
            if not core.startswith(start):
                if start.startswith(core):
                    self._core = core
                    return "", ""
                self._state = "answer"
                answer, self._lead = "".join(self._lead), []
                return "", answer
            self._state, self._lead, text = "reasoning", [], core[len(start) :]
        reasoning = ""
        if self._state == "reasoning":
            text, self._held = self._held + text, ""
            end = text.find(end_tag)
            if end == -1:
                self._held = text[len(text) - partial_tag_len(text, end_tag) :]
                return text[: len(text) - len(self._held)], ""
            self._state, self._strip_newlines = "answer", True
            reasoning, text = text[:end], text[end + len(end_tag) :]
        if self._strip_newlines:
            text = text.lstrip("\n")
            self._strip_newlines = not text
        return reasoning, text


REASONING_PARSERS: dict[str, type[Qwen3ReasoningParser]] = {
    Qwen3ReasoningParser.name: Qwen3ReasoningParser
}
