"""POST /v1/chat/completions: messages (and tools) rendered with the model's chat
template, answered as JSON or as an SSE stream of deltas; chat-shaped logprobs, `n`
choices; tool calls and reasoning parsed out of the text (server/chat_output.py), a forced
tool call constrained by its grammar."""

from __future__ import annotations

import time
from collections.abc import Iterator

from fastapi import Request
from fastapi.responses import Response
from orjson import Fragment

from engine.outputs import RequestOutput, RequestStream
from scheduler.output import SampleLogprobs
from scheduler.sampling_params import SamplingParams
from server.admission import Admitted
from server.chat_output import (
    ChatOutputParser,
    chat_output_parser,
    forced_tool_grammar,
    tool_parser_for,
)
from server.errors import APIError
from server.rendering import Choice, json_response, response_json, usage
from server.requests import ChatCompletionRequest
from server.responses import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    DeltaMessage,
    random_id,
)
from server.serving import Serving
from server.streaming import (
    Event,
    chunk_head,
    delta_events,
    event_stream,
    fast_chunk,
    model_event,
    sse_data,
)
from server.tool_parsers import ToolParser


class ChatCompletions:
    """The chat completions route over the shared `Serving`."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def __call__(self, raw: Request) -> Response:
        serving = self.serving
        arrival = time.monotonic()
        body, admitted = await serving.parse(raw, ChatCompletionRequest, arrival)
        prompt, params, tool_parser = await self.prepare(body, admitted)
        request_id = random_id("chatcmpl")
        stream = serving.submit(request_id, [prompt], params, body, admitted, arrival)
        if body.stream:
            return self._stream(request_id, stream, body, prompt, tool_parser)
        choices = await serving.collect(stream, raw)
        if choices is None:
            return Response(status_code=499)
        prompt_logprobs = serving.prompt_logprobs_json([prompt], body.n, body.prompt_logprobs)

        def render() -> bytes:
            response = ChatCompletionResponse(
                id=request_id,
                model=serving.reported_model(body.model),
                choices=[self._choice(i, c, body, self.output_parser(body, tool_parser))
                         for i, c in enumerate(choices)],
                usage=usage([prompt], choices),
            )
            return response_json(
                response, [prompt_logprobs(i, c.prompt_logprobs) for i, c in enumerate(choices)]
            )

        return json_response(await serving.render(params, render))

    async def prepare(
        self, body: ChatCompletionRequest, admitted: Admitted
    ) -> tuple[list[int], SamplingParams, ToolParser | None]:
        """An admitted request's prompt (through the chat template, checked against the
        context), sampling parameters (with the output grammar) and tool parser: the work
        before submitting, shared with POST /v1/responses (server/responses_api.py)."""
        serving = self.serving
        tool_parser = self._tool_parser(body)
        prompt = await serving.in_pool(serving.render_chat, body)
        admitted.num_tokenized += len(prompt)
        serving.check_prompt(prompt, body.requested_max_tokens or 0)
        max_tokens = body.requested_max_tokens or serving.engine.info.max_model_len - len(prompt)
        grammar = await serving.grammar(body, lambda: forced_tool_grammar(body, tool_parser))
        params = serving.sampling_params(body, max_tokens, body.num_logprobs, grammar)
        return prompt, params, tool_parser

    def _choice(
        self, index: int, choice: Choice, body: ChatCompletionRequest,
        parser: ChatOutputParser | None,
    ) -> ChatCompletionChoice:
        message = ChatResponseMessage(content=choice.text)
        finish_reason = choice.finish_reason
        if parser is not None:
            parsed = parser.parse(choice.text)
            message = ChatResponseMessage(content=parsed.content,
                                          reasoning_content=parsed.reasoning,
                                          tool_calls=parsed.tool_calls or None)
            if parsed.tool_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        return ChatCompletionChoice(
            index=index,
            message=message,
            logprobs=self._logprobs(choice.token_ids, choice.logprobs) if body.logprobs else None,
            finish_reason=finish_reason,  # type: ignore[arg-type]
            num_preemptions=choice.num_preemptions,
            slo=choice.slo,
        )

    def _tool_parser(self, body: ChatCompletionRequest) -> ToolParser | None:
        try:
            return tool_parser_for(body, self.serving.config.tool_call_parser)
        except ValueError as exc:
            raise APIError(400, str(exc), param="tool_choice") from exc

    def output_parser(
        self, body: ChatCompletionRequest, tool_parser: ToolParser | None
    ) -> ChatOutputParser | None:
        """The parser of one choice's text (None: it is all content)."""
        return chat_output_parser(body, tool_parser, self.serving.config.reasoning_parser)

    def _stream(
        self,
        request_id: str,
        stream: RequestStream,
        body: ChatCompletionRequest,
        prompt: list[int],
        tool_parser: ToolParser | None,
    ) -> Response:
        created = int(time.time())
        model = self.serving.reported_model(body.model)
        choices = {i: Choice() for i in range(body.n)}
        parsers = {i: self.output_parser(body, tool_parser) for i in choices}
        head = chunk_head(request_id, "chat.completion.chunk", created, model)
        prompt_logprobs = self.serving.prompt_logprobs_json([prompt], body.n, body.prompt_logprobs)

        def chunk(choice: ChatCompletionStreamChoice, fragment: Fragment | None = None) -> Event:
            c = ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice])
            return model_event(c, fragment)

        def prelude() -> Iterator[Event]:
            for i in choices:
                yield chunk(ChatCompletionStreamChoice(
                    index=i, delta=DeltaMessage(role="assistant", content="")
                ))

        def logprobs_of(output: RequestOutput, _: int) -> ChatChoiceLogprobs | None:
            if not body.logprobs:
                return None
            return self._logprobs(output.token_ids, output.logprobs or [])

        def event_of(output: RequestOutput, logprobs: ChatChoiceLogprobs | None) -> Event | None:
            parser = parsers[output.index]
            if logprobs is None and parser is None and output.prompt_logprobs is None:
                return fast_chunk(head, output,
                                  {"delta": {"content": output.text} if output.text else {}})
            delta = _delta(parser, output, logprobs is not None)
            if delta is None:
                return None  # the parser holds the text back (a tool call in the making)
            message, finish_reason = delta
            return chunk(ChatCompletionStreamChoice(
                index=output.index,
                delta=message,
                logprobs=logprobs,
                finish_reason=finish_reason,  # type: ignore[arg-type]
                num_preemptions=output.num_preemptions if output.finished else None,
                slo=output.slo,
            ), prompt_logprobs(output.index, output.prompt_logprobs))

        def usage_event() -> str:
            c = ChatCompletionChunk(id=request_id, created=created, model=model, choices=[],
                                    usage=usage([prompt], list(choices.values())))
            return sse_data(c.model_dump_json())

        deltas = delta_events(stream, choices, logprobs_of, event_of, self.serving.off_loop)
        return event_stream(self.serving.engine, stream, prelude(), deltas,
                            usage_event if body.include_usage_in_stream else None)

    def _logprobs(
        self, token_ids: list[int], logprobs: list[SampleLogprobs]
    ) -> ChatChoiceLogprobs:
        token_text = self.serving.token_text
        content = []
        for token_id, sample in zip(token_ids, logprobs, strict=False):
            token = token_text(token_id)
            content.append(ChatTokenLogprob(
                token=token,
                logprob=sample.logprob,
                bytes=list(token.encode()),
                top_logprobs=[
                    ChatTopLogprob(token=(t := token_text(tid)), logprob=lp,
                                   bytes=list(t.encode()))
                    for tid, lp in sample.top
                ],
            ))
        return ChatChoiceLogprobs(content=content)


def _delta(
    parser: ChatOutputParser | None, output: RequestOutput, has_logprobs: bool
) -> tuple[DeltaMessage, str | None] | None:
    """A streamed output as a chat delta, with its finish reason ("tool_calls" once its
    parser found a call); None when the parser holds all of its text back and the output
    carries nothing else (no logprobs, no prompt logprobs, no finish)."""
    if parser is None:
        return DeltaMessage(content=output.text or None), output.finish_reason
    message = parser.feed(output.text, output.finished)
    finish_reason = output.finish_reason
    if finish_reason == "stop" and parser.called_tools:
        finish_reason = "tool_calls"
    if (message == DeltaMessage() and not has_logprobs and not output.finished
            and output.prompt_logprobs is None):
        return None
    return message, finish_reason
