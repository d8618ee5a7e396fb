"""Incremental detokenization with stop strings.

A tokenizer on the `tokenizers` library (the served one, model_runner/text_tokenizer.py,
or transformers' fast one) decodes each new token once, with its `DecodeStream` (primed
with the prompt's last tokens). Any other tokenizer decodes a short window per token (a
few already-read ones for context, so that tokenizers that drop a leading space when
decoding a lone token still get it right) and emits only the new text. Text is held back
while:
- it ends in U+FFFD: a multi-byte character split across tokens is not complete yet;
- its tail could be the start of a stop string: it is sent once that is ruled out.
A matched stop string and everything after it are never sent (with
`include_stop_str_in_output`, the stop string itself is).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tokenizers.decoders import DecodeStream

_REPLACEMENT_CHAR = "\ufffd"
_PROMPT_CONTEXT_TOKENS = 5


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass
class DetokenizerDelta:
    text: str
    stopped: bool


class IncrementalDetokenizer:
    """Turns a request's output tokens, a few at a time, into text deltas."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._include_stop = include_stop_str_in_output
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._backend: Any = getattr(tokenizer, "backend_tokenizer", None)
        self._stream: DecodeStream | None = None
        if self._backend is not None:
            self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._token_ids = context
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(context)  # tokens before this are already in `_text`
        self._text = ""  # decoded output text (cut at a stop string once matched)
        self._num_sent = 0  # chars of `_text` already returned
        self.stopped = False

    def step(self, new_token_ids: Sequence[int]) -> DetokenizerDelta:
        """Add new output tokens; return the text now safe to send and whether a stop matched.

        After a stop string matched, further calls return nothing.
        """
        if self.stopped:
            return DetokenizerDelta("", True)
        for token_id in new_token_ids:
            self._token_ids.append(token_id)
            text_start = len(self._text)
            self._text += self._decode_new()
            if self._stop and self._match_stop(text_start):
                self.stopped = True
                break
        end = len(self._text) if self.stopped else len(self._text) - self._held_back()
        delta = self._text[self._num_sent : end]
        self._num_sent = max(self._num_sent, end)
        return DetokenizerDelta(delta, self.stopped)

    def flush(self) -> str:
        """At the end of the request: the text still held back (an incomplete character
        decodes as U+FFFD, a partial stop string is plain text after all)."""
        if not self.stopped:
            tail = self._decode(self._token_ids[self._prefix_offset :])
            head = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
            self._text += tail[len(head) :]
            self._read_offset = len(self._token_ids)
        delta = self._text[self._num_sent :]
        self._num_sent = len(self._text)
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_new(self) -> str:
        if self._stream is not None:
            piece = self._stream.step(self._backend, self._token_ids[-1])
            if not piece:
                return ""  # a character still incomplete (or a skipped special token)
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._token_ids)
            return str(piece)
        head = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._token_ids[self._prefix_offset :])
        if len(full) <= len(head) or full.endswith(_REPLACEMENT_CHAR):
            return ""  # nothing new yet, or a character still incomplete
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return full[len(head) :]

    def _match_stop(self, text_start: int) -> bool:
        """Cut `_text` at the earliest stop string ending in the text added at text_start."""
        best, best_end = -1, -1
        for stop in self._stop:
            i = self._text.find(stop, max(0, text_start - len(stop) + 1))
            if i != -1 and (best == -1 or i < best):
                best, best_end = i, i + len(stop)
        if best == -1:
            return False
        self._text = self._text[: best_end if self._include_stop else best]
        return True

    def _held_back(self) -> int:
        """Length of the longest tail of the unsent text that starts some stop string."""
        unsent = len(self._text) - self._num_sent
        longest = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, unsent), longest, -1):
                if self._text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
