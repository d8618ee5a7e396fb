"""POST /v1/responses: OpenAI's Responses API as a translation layer over the chat route.

The body (server/responses_request.py) becomes a chat request, which is admitted,
rendered, constrained and submitted exactly as POST /v1/chat/completions does it
(server/chat.py's `prepare`); its one choice is parsed by the chat route's output parser
(reasoning, content, tool calls) and answered as a Responses object, whole or as the
Responses event stream (server/responses_events.py). Responses are not stored.
"""

from __future__ import annotations

import time

import orjson
from fastapi import Request
from fastapi.responses import Response

from engine.outputs import RequestOutput, RequestStream
from server.chat import ChatCompletions
from server.chat_output import ChatOutputParser, ParsedChat
from server.rendering import Choice, json_response
from server.responses import DeltaMessage
from server.responses_events import (
    ResponseEvents,
    ResponseHead,
    item_id,
    output_items,
    response_head,
    response_usage,
    status_of,
)
from server.responses_request import ResponsesRequest, chat_request, check_supported
from server.serving import Serving
from server.streaming import Event, delta_events, event_stream


class Responses:
    """The Responses route over the shared `Serving` and the chat route's work."""

    def __init__(self, serving: Serving, chat: ChatCompletions) -> None:
        self.serving = serving
        self.chat = chat

    async def __call__(self, raw: Request) -> Response:
        serving = self.serving
        arrival = time.monotonic()
        request = await serving.parse_json(raw, ResponsesRequest)
        check_supported(request)
        body = chat_request(request)
        admitted = serving.admit(raw, body, arrival)
        prompt, params, tool_parser = await self.chat.prepare(body, admitted)
        head = response_head(request, item_id("resp"), serving.reported_model(body.model))
        stream = serving.submit(head.id, [prompt], params, body, admitted, arrival)
        parser = self.chat.output_parser(body, tool_parser)
        if request.stream:
            return self._stream(head, stream, prompt, parser)
        choices = await serving.collect(stream, raw)
        if choices is None:
            return Response(status_code=499)
        [choice] = choices
        parsed = parser.parse(choice.text) if parser is not None else ParsedChat(None,
                                                                                 choice.text)
        status, reason = status_of(choice.finish_reason)
        items = output_items(parsed, "incomplete" if status == "incomplete" else "completed")
        response = head.response(status, items, response_usage(prompt, choice), reason)
        return json_response(orjson.dumps(response))

    def _stream(
        self, head: ResponseHead, stream: RequestStream, prompt: list[int],
        parser: ChatOutputParser | None,
    ) -> Response:
        events = ResponseEvents(head)
        choices = {0: Choice()}

        def event_of(output: RequestOutput, _: None) -> Event | None:
            if parser is None:
                delta = DeltaMessage(content=output.text or None)
            else:
                delta = parser.feed(output.text, output.finished)
            event = events.feed(delta)
            if output.finished:
                event += events.finish(output.finish_reason, response_usage(prompt, choices[0]))
            return event or None

        deltas = delta_events(stream, choices, lambda output, offset: None, event_of,
                              self.serving.off_loop)
        return event_stream(self.serving.engine, stream, [events.start()], deltas, None,
                            error_event=events.error, done=None)
