"""Reasoning text split from the answer (`--reasoning-parser`).

`qwen3`: output that starts with `<think>` is reasoning up to `</think>`, the rest is the
answer; output without it is all answer (Qwen3 with `enable_thinking` off gets an empty
think block in its prompt). `split(text, final=False)` reads a stream so far and holds
back a tail that may be the start of `</think>`, so a prefix's parts are prefixes of the
final parts.
"""

from __future__ import annotations

from typing import ClassVar

from server.tool_parsers import partial_tag_len


class Qwen3ReasoningParser:
    name: ClassVar[str] = "qwen3"
    START, END = "<think>", "</think>"

    def split(self, text: str, final: bool = True) -> tuple[str, str]:
        """(reasoning, answer) of `text`."""
        stripped = text.lstrip()
        if not stripped.startswith(self.START):
            if not final and self.START.startswith(stripped):
                return "", ""  # may still become <think>
            return "", text
        body = stripped[len(self.START) :]
        end = body.find(self.END)
        if end == -1:
            if final:
                return body, ""  # cut off while thinking
            return body[: len(body) - partial_tag_len(body, self.END)], ""
        return body[:end], body[end + len(self.END) :].lstrip("\n")


REASONING_PARSERS: dict[str, type[Qwen3ReasoningParser]] = {
    Qwen3ReasoningParser.name: Qwen3ReasoningParser
}
