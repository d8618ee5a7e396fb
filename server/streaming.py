"""Server-sent event streams of the generation routes, written once for both.

A stream is a prelude (each chat choice's role), one chunk per engine
output that carries text, logprobs or a finish reason, an optional usage chunk, and
`data: [DONE]`, after an error event when a step failed. A chunk without logprobs (the
common case) is encoded with orjson from a head encoded once per stream; a chunk with
logprobs goes through the pydantic chunk models, and one with prompt logprobs is written
on a render thread, their JSON (written once per prompt) spliced in. A client that goes
away mid-stream aborts its request. (The Responses stream, server/responses_events.py,
writes its own events and error event, and ends without [DONE].)
"""

from __future__ import annotations

from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
)
from typing import Any

import orjson
import pydantic
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.client import EngineClient
from engine.data_parallel import DataParallelEngine
from engine.outputs import EngineStepError, RequestOutput, RequestStream
from server.rendering import Choice, response_json
from server.responses import ErrorInfo, ErrorResponse

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

Event = str | bytes


def sse_data(payload: str) -> str:
    return f"data: {payload}\n\n"


def model_event(chunk: pydantic.BaseModel, prompt_logprobs: orjson.Fragment | None) -> Event:
    """The SSE event of a chunk model; its one choice with `prompt_logprobs` (JSON written
    once per prompt: server/rendering.py's PromptLogprobsJSON) when given."""
    if prompt_logprobs is None:
        return sse_data(chunk.model_dump_json())
    return b"data: " + response_json(chunk, [prompt_logprobs]) + b"\n\n"


def chunk_head(request_id: str, kind: str, created: int, model: str) -> bytes:
    """`data: {"id":...,"object":...,"created":...,"model":...,"choices":[` of a stream's
    chunks, encoded once per stream."""
    head = orjson.dumps({"id": request_id, "object": kind, "created": created, "model": model})
    return b"data: " + head[:-1] + b',"choices":['


def fast_chunk(head: bytes, output: RequestOutput, content: dict[str, Any]) -> bytes:
    """The SSE event of a chunk without logprobs, encoded with orjson: the same JSON as
    the chunk models (CompletionStreamChoice / ChatCompletionStreamChoice) write."""
    choice: dict[str, Any] = {"index": output.index, **content, "logprobs": None,
                              "finish_reason": output.finish_reason}
    if output.finished:
        choice["num_preemptions"] = output.num_preemptions
        if output.slo is not None:
            choice["slo"] = output.slo
    return head + orjson.dumps(choice) + b"]}\n\n"


async def delta_events(
    stream: AsyncIterable[RequestOutput],
    choices: dict[int, Choice],
    logprobs_of: Callable[[RequestOutput, int], Any | None],
    event_of: Callable[[RequestOutput, Any], Event | None],
    off_loop: Callable[..., Awaitable[Event | None]],
) -> AsyncIterator[Event]:
    """One event per output of `stream` worth sending, each output added to its choice.

    `logprobs_of(output, text_offset)` gives an output's logprobs in the route's shape
    (None when the request asked for none); `event_of(output, logprobs)` the event of a
    chunk (None: nothing to send), called through `off_loop(event_of, output, logprobs)`
    (a render thread) for an output with prompt logprobs, whose JSON can be megabytes.
    An output with no text, no logprobs (nor prompt logprobs) and no finish is never sent.
    """
    async for output in stream:
        choice = choices[output.index]
        text_offset = len(choice.text)
        choice.add(output)
        logprobs = logprobs_of(output, text_offset) if output.token_ids else None
        if (
            not output.text and logprobs is None and output.prompt_logprobs is None
            and not output.finished
        ):
            continue
        if output.prompt_logprobs is None:
            event = event_of(output, logprobs)
        else:
            event = await off_loop(event_of, output, logprobs)
        if event is not None:
            yield event


def _error_event(error: EngineStepError) -> Event:
    """OpenAI's error object as a stream's event (a failed step)."""
    kind = "invalid_request_error" if error.status_code == 400 else "server_error"
    return sse_data(ErrorResponse(error=ErrorInfo(message=str(error), type=kind))
                    .model_dump_json())


def event_stream(
    engine: EngineClient | DataParallelEngine,
    stream: RequestStream,
    prelude: Iterable[Event],
    deltas: AsyncIterator[Event],
    usage_event: Callable[[], Event] | None,
    error_event: Callable[[EngineStepError], Event] = _error_event,
    done: Event | None = "data: [DONE]\n\n",
) -> StreamingResponse:
    """The SSE response: `prelude`, `deltas`, then `usage_event()` when given, and `done`
    (after `error_event(error)` on failure, by default OpenAI's error object); aborts the
    request if the client leaves."""

    async def events() -> AsyncGenerator[Event, None]:
        try:
            for event in prelude:
                yield event
            async for event in deltas:
                yield event
            if usage_event is not None:
                yield usage_event()
        except EngineStepError as exc:
            yield error_event(exc)
        finally:
            if not stream.finished:
                engine.abort(stream.request_id)
        if done is not None:
            yield done

    return _EventStreamResponse(events(), media_type="text/event-stream",
                                headers=_SSE_HEADERS)


class _EventStreamResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator, so that the generator's
    `finally` (which aborts the request) runs even when the client went away while a
    chunk was being sent rather than while the generator was waiting for one."""

    body_iterator: AsyncGenerator[Event, None]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
