"""POST /v1/chat/completions: messages rendered with the model's chat template, answered
as JSON or as an SSE stream of deltas; chat-shaped logprobs, `n` choices."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from scheduler.output import SampleLogprobs
from server.engine import RequestOutput, RequestStream
from server.errors import APIError
from server.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    DeltaMessage,
    random_id,
)
from server.serving import Choice, Serving, json_response, usage
from server.streaming import Event, chunk_head, delta_events, event_stream, sse_data


class ChatCompletions:
    """The chat completions route over the shared `Serving`."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def __call__(self, raw: Request) -> Response:
        serving = self.serving
        arrival = time.monotonic()
        body, placement = await serving.parse(raw, ChatCompletionRequest, arrival)
        prompt = await serving.in_pool(self._render, body)
        serving.check_prompt(prompt, body.requested_max_tokens or 0)
        max_tokens = body.requested_max_tokens or serving.engine.info.max_model_len - len(prompt)
        params = serving.sampling_params(body, max_tokens, body.num_logprobs)
        request_id = random_id("chatcmpl")
        stream = serving.submit(request_id, [prompt], params, body, placement, arrival)
        if body.stream:
            return self._stream(request_id, stream, body, prompt)
        choices = await serving.collect(stream, raw)
        if choices is None:
            return Response(status_code=499)
        return json_response(ChatCompletionResponse(
            id=request_id,
            model=serving.model_name,
            choices=[
                ChatCompletionChoice(
                    index=i,
                    message=ChatResponseMessage(content=c.text),
                    logprobs=self._logprobs(c.token_ids, c.logprobs) if body.logprobs else None,
                    finish_reason=c.finish_reason,  # type: ignore[arg-type]
                    num_preemptions=c.num_preemptions,
                )
                for i, c in enumerate(choices)
            ],
            usage=usage([prompt], choices),
        ))

    def _render(self, body: ChatCompletionRequest) -> list[int]:
        """On the tokenizer thread."""
        serving = self.serving
        messages = [m.to_template_dict() for m in body.messages]
        try:
            text = serving.pool_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # jinja errors: the messages do not fit the template
            raise APIError(400, f"Cannot apply the chat template: {exc}", param="messages") from exc
        serving.check_prompt_chars(text, "rendered chat", "messages")
        return serving.encode(text, add_special_tokens=False)

    def _stream(
        self,
        request_id: str,
        stream: RequestStream,
        body: ChatCompletionRequest,
        prompt: list[int],
    ) -> Response:
        created = int(time.time())
        model = self.serving.model_name
        choices = {i: Choice() for i in range(body.n)}

        def chunk(choice: ChatCompletionStreamChoice) -> str:
            c = ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice])
            return sse_data(c.model_dump_json())

        def prelude() -> Iterator[Event]:
            for i in choices:
                yield chunk(ChatCompletionStreamChoice(
                    index=i, delta=DeltaMessage(role="assistant", content="")
                ))

        def logprobs_of(output: RequestOutput, _: int) -> ChatChoiceLogprobs | None:
            if not body.logprobs:
                return None
            return self._logprobs(output.token_ids, output.logprobs or [])

        def content_of(output: RequestOutput) -> dict[str, Any]:
            return {"delta": {"content": output.text} if output.text else {}}

        def chunk_with_logprobs(output: RequestOutput, logprobs: ChatChoiceLogprobs) -> str:
            return chunk(ChatCompletionStreamChoice(
                index=output.index,
                delta=DeltaMessage(content=output.text or None),
                logprobs=logprobs,
                finish_reason=output.finish_reason,  # type: ignore[arg-type]
                num_preemptions=output.num_preemptions if output.finished else None,
            ))

        def usage_event() -> str:
            c = ChatCompletionChunk(id=request_id, created=created, model=model, choices=[],
                                    usage=usage([prompt], list(choices.values())))
            return sse_data(c.model_dump_json())

        head = chunk_head(request_id, "chat.completion.chunk", created, model)
        deltas = delta_events(stream, choices, head, logprobs_of, content_of,
                              chunk_with_logprobs)
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
