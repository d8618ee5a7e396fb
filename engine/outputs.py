"""What a handler gets of its request: outputs per choice, through its stream.

A stream holds one merging slot per choice, so that a client that stops reading holds no
growing queue; a failed step or a dead engine ends it with an error once the text before
is read.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from scheduler.output import PromptLogprobs, SampleLogprobs
from scheduler.placement import Placement


class EngineDeadError(RuntimeError):
    """The engine core is not running (it died, or the server is shutting down)."""


class EngineStepError(RuntimeError):
    """A step that included this request failed (or the core died), or the request
    failed alone by its own fault (`status_code` 400: its grammar); the request ended."""

    def __init__(self, message: str, status_code: int = 500) -> None:
        super().__init__(message)
        self.status_code = status_code


@dataclass
class RequestOutput:
    """What one or more steps produced for one choice of a request.

    `text` and `token_ids` are new since the previous output. `finish_reason` is set on
    the choice's last output; `error` is set instead when a step failed.
    `prompt_logprobs` (when asked for) comes whole with the first output that has tokens;
    the choices of a prompt that share them (n > 1) hold the very same object.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[SampleLogprobs] | None
    finish_reason: str | None
    num_preemptions: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    error: str | None = None
    error_status: int = 500
    prompt_logprobs: PromptLogprobs | None = None
    slo: dict[str, bool] | None = None  # on the last output: each latency target met

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def merged(self, later: RequestOutput) -> RequestOutput:
        """This output followed by `later` (of the same choice) as one."""
        logprobs = self.logprobs
        if later.logprobs is not None:
            logprobs = [*(logprobs or []), *later.logprobs]
        return replace(
            later,
            text=self.text + later.text,
            token_ids=self.token_ids + later.token_ids,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
        )


def slo_verdict(placement: Placement, first_token: float | None, last_token: float | None,
                num_output_tokens: int) -> dict[str, bool] | None:
    """Whether a finished choice met each latency target it carries (`ttft_met`: its
    first token by the deadline; `tpot_met`: its mean gap after it within tpot_s); None
    without targets."""
    verdict = {}
    if placement.ttft_deadline is not None:
        verdict["ttft_met"] = first_token is not None and first_token <= placement.ttft_deadline
    if placement.tpot_s is not None:
        gap = 0.0
        if first_token is not None and last_token is not None:
            gap = (last_token - first_token) / max(num_output_tokens - 1, 1)
        verdict["tpot_met"] = first_token is not None and gap <= placement.tpot_s
    return verdict or None


class RequestStream:
    """The handler's end of a request: yields the outputs of all its choices until every
    choice finished; raises EngineStepError when a step failed it.

    Outputs not yet read merge into one pending output per choice; an error is raised
    once the outputs before it are read. Everything happens on the engine's event loop."""

    def __init__(self, request_id: str, num_choices: int) -> None:
        self.request_id = request_id
        self._pending: dict[int, RequestOutput] = {}
        self._error: EngineStepError | None = None  # raised once the text is out
        self._ready = asyncio.Event()
        self._num_unfinished = num_choices

    @property
    def finished(self) -> bool:
        return self._num_unfinished == 0

    def push(self, output: RequestOutput) -> None:
        if output.error is not None:
            self._error = self._error or EngineStepError(output.error, output.error_status)
        else:
            earlier = self._pending.get(output.index)
            self._pending[output.index] = output if earlier is None else earlier.merged(output)
        self._ready.set()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while self._num_unfinished:
            if self._pending:
                outputs = list(self._pending.values())
                self._pending.clear()
                for output in outputs:
                    if output.finished:
                        self._num_unfinished -= 1
                    yield output
            elif self._error is not None:
                self._num_unfinished = 0
                raise self._error
            else:
                self._ready.clear()
                await self._ready.wait()
