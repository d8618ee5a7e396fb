"""A generation response's parts: the choices gathered from the engine's outputs, usage,
and the JSON written (prompt logprobs once per prompt, shared by its choices, spliced in
as they are).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import pydantic
from fastapi.responses import Response

from engine.outputs import RequestOutput
from scheduler.output import PromptLogprobs, SampleLogprobs
from server.responses import PromptTokensDetails, UsageInfo


@dataclass
class Choice:
    """A choice's text, tokens and logprobs gathered from its outputs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampleLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    slo: dict[str, bool] | None = None

    def add(self, output: RequestOutput) -> None:
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.text += output.text
        self.token_ids.extend(output.token_ids)
        self.logprobs.extend(output.logprobs or [])
        self.num_output_tokens = output.num_output_tokens
        self.num_preemptions = output.num_preemptions
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if output.finish_reason is not None:
            self.finish_reason = output.finish_reason
            self.slo = output.slo


def usage(prompts: list[list[int]], choices: Sequence[Choice]) -> UsageInfo:
    """Usage of a request: each prompt counted once, as are its cached tokens (those of
    its first choice, which computes the prompt for the others)."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(c.num_output_tokens for c in choices)
    n = max(1, len(choices) // max(1, len(prompts)))
    cached_tokens = sum(c.num_cached_tokens for c in choices[::n])
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def json_response(content: bytes) -> Response:
    """A response's JSON (`response_json`) as the HTTP response."""
    return Response(content, media_type="application/json")


class PromptLogprobsJSON:
    """vLLM's `prompt_logprobs` of a request's choices as JSON: None for the first prompt
    token, then per token {token id: {logprob, rank, decoded_token}} of the token itself
    and its top-k (`num_top`, what the request asked for: the engine may have computed
    more for `echo`; None: nothing written). Written once per prompt: the choices of a
    prompt that share their prompt logprobs (n > 1: the very same object) share its JSON
    too."""

    def __init__(
        self,
        token_text: Callable[[int], str],
        prompts: list[list[int]],
        n: int,
        num_top: int | None,
    ) -> None:
        self._token_text = token_text
        self._prompts = prompts
        self._n = n
        self._num_top = num_top
        self._texts: dict[int, str] = {}
        self._written: dict[int, tuple[PromptLogprobs, orjson.Fragment]] = {}  # by prompt

    def __call__(self, index: int, logprobs: PromptLogprobs | None) -> orjson.Fragment | None:
        """Choice `index`'s (None when the request asked for none)."""
        if logprobs is None or self._num_top is None:
            return None
        p = index // self._n
        written = self._written.get(p)
        if written is None or written[0] is not logprobs:
            entries = self._entries(self._prompts[p], logprobs)
            written = self._written[p] = (logprobs, orjson.Fragment(orjson.dumps(entries)))
        return written[1]

    def _entries(self, prompt: list[int], logprobs: PromptLogprobs) -> list[Any]:
        result: list[Any] = [None]
        for i, (logprob, rank, top) in enumerate(
            zip(logprobs.logprobs, logprobs.ranks, logprobs.top, strict=True)
        ):
            token_id = prompt[logprobs.start + i]
            tokens = {str(token_id): self._entry(token_id, logprob, rank)}
            for j, (top_id, top_logprob) in enumerate(top[: self._num_top]):
                tokens.setdefault(str(top_id), self._entry(top_id, top_logprob, j + 1))
            result.append(tokens)
        return result

    def _entry(self, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        """A `PromptLogprob` (server/responses.py) as a dict."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._token_text(token_id)
        return {"logprob": logprob, "rank": rank, "decoded_token": text}


def response_json(
    model: pydantic.BaseModel, prompt_logprobs: Sequence[orjson.Fragment | None]
) -> bytes:
    """`model` (a response or a chunk) as JSON, its choice i with `prompt_logprobs[i]` (the
    JSON written once per prompt, spliced in as it is). NaN and infinities are null, as
    pydantic writes them."""
    if all(p is None for p in prompt_logprobs):
        return model.model_dump_json().encode()
    data = model.model_dump(mode="json")
    for choice, fragment in zip(data["choices"], prompt_logprobs, strict=True):
        if fragment is not None:
            choice["prompt_logprobs"] = fragment
    return orjson.dumps(data)
