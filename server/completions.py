"""POST /v1/completions: prompts (text or token ids, one or several) to completions, as
JSON or as an SSE stream; `echo`, completions-shaped logprobs, `n` choices per prompt."""

from __future__ import annotations

import time
from collections.abc import Iterator

from fastapi import Request
from fastapi.responses import Response
from orjson import Fragment

from engine.outputs import RequestOutput, RequestStream
from scheduler.output import SampleLogprobs
from server.rendering import Choice, json_response, response_json, usage
from server.requests import CompletionRequest
from server.responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
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

_DEFAULT_MAX_TOKENS = 16


class Completions:
    """The completions route over the shared `Serving`."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def __call__(self, raw: Request) -> Response:
        serving = self.serving
        arrival = time.monotonic()
        body, placement = await serving.parse(raw, CompletionRequest, arrival)
        max_tokens = body.max_tokens or _DEFAULT_MAX_TOKENS
        prompts: list[list[int]] = []
        if isinstance(body.prompts[0], str):
            texts = [str(p) for p in body.prompts]
            for text in texts:  # one by one: the first prompt over a limit ends the work
                serving.check_prompt_chars(text, "prompt", "prompt")
                prompts.append(await serving.in_pool(serving.encode, text, True))
                serving.check_prompt(prompts[-1], max_tokens)
        else:
            prompts = [list(p) for p in body.prompts]
            for prompt in prompts:
                serving.check_prompt(prompt, max_tokens)
            texts = await serving.in_pool(serving.decode_all, prompts) if body.echo else []
        grammar = await serving.grammar(body)
        params = serving.sampling_params(body, max_tokens, body.logprobs, grammar)
        request_id = random_id("cmpl")
        stream = serving.submit(request_id, prompts, params, body, placement, arrival)
        echo = texts if body.echo else None
        if body.stream:
            return self._stream(request_id, stream, body, prompts, echo)
        choices = await serving.collect(stream, raw)
        if choices is None:
            return Response(status_code=499)
        prompt_logprobs = serving.prompt_logprobs_json(prompts, body.n)

        def render() -> bytes:
            response = CompletionResponse(
                id=request_id,
                model=serving.model_name,
                choices=[
                    self._choice(i, c, body, prompts[i // body.n], echo)
                    for i, c in enumerate(choices)
                ],
                usage=usage(prompts, choices),
            )
            return response_json(
                response, [prompt_logprobs(i, c.prompt_logprobs) for i, c in enumerate(choices)]
            )

        return json_response(await serving.render(params, render))

    def _stream(
        self,
        request_id: str,
        stream: RequestStream,
        body: CompletionRequest,
        prompts: list[list[int]],
        echo: list[str] | None,
    ) -> Response:
        created = int(time.time())
        model = self.serving.model_name
        choices = {i: Choice() for i in range(len(prompts) * body.n)}
        head = chunk_head(request_id, "text_completion", created, model)
        prompt_logprobs = self.serving.prompt_logprobs_json(prompts, body.n)

        def chunk(choice: CompletionStreamChoice, fragment: Fragment | None = None) -> Event:
            response = CompletionStreamResponse(id=request_id, created=created, model=model,
                                                choices=[choice])
            return model_event(response, fragment)

        def prelude() -> Iterator[Event]:
            if echo is None:
                return
            for i, choice in choices.items():
                choice.text = echo[i // body.n]
                logprobs = None
                if body.logprobs is not None:
                    logprobs = self._logprobs(prompts[i // body.n], [], [], 0)
                yield chunk(CompletionStreamChoice(index=i, text=choice.text, logprobs=logprobs))

        def logprobs_of(output: RequestOutput, text_offset: int) -> CompletionLogprobs | None:
            if body.logprobs is None:
                return None
            return self._logprobs([], output.token_ids, output.logprobs or [], text_offset)

        def event_of(output: RequestOutput, logprobs: CompletionLogprobs | None) -> Event:
            if logprobs is None and output.prompt_logprobs is None:
                return fast_chunk(head, output, {"text": output.text})
            return chunk(CompletionStreamChoice(
                index=output.index,
                text=output.text,
                logprobs=logprobs,
                finish_reason=output.finish_reason,  # type: ignore[arg-type]
                num_preemptions=output.num_preemptions if output.finished else None,
            ), prompt_logprobs(output.index, output.prompt_logprobs))

        def usage_event() -> str:
            response = CompletionStreamResponse(
                id=request_id, created=created, model=model, choices=[],
                usage=usage(prompts, list(choices.values())),
            )
            return sse_data(response.model_dump_json())

        deltas = delta_events(stream, choices, logprobs_of, event_of, self.serving.off_loop)
        return event_stream(self.serving.engine, stream, prelude(), deltas,
                            usage_event if body.include_usage_in_stream else None)

    def _choice(
        self,
        index: int,
        choice: Choice,
        body: CompletionRequest,
        prompt: list[int],
        echo: list[str] | None,
    ) -> CompletionChoice:
        prefix = echo[index // body.n] if echo is not None else ""
        logprobs = None
        if body.logprobs is not None:
            logprobs = self._logprobs(
                prompt if echo is not None else [], choice.token_ids, choice.logprobs, 0
            )
        return CompletionChoice(
            index=index,
            text=prefix + choice.text,
            logprobs=logprobs,
            finish_reason=choice.finish_reason,  # type: ignore[arg-type]
            num_preemptions=choice.num_preemptions,
        )

    def _logprobs(
        self,
        prompt_ids: list[int],
        token_ids: list[int],
        logprobs: list[SampleLogprobs],
        text_offset: int,
    ) -> CompletionLogprobs:
        """Completions-shaped logprobs; echoed prompt tokens have none (not computed)."""
        token_text = self.serving.token_text
        result = CompletionLogprobs()
        offset = text_offset
        for token_id in prompt_ids:
            token = token_text(token_id)
            result.tokens.append(token)
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            result.text_offset.append(offset)
            offset += len(token)
        for token_id, sample in zip(token_ids, logprobs, strict=False):
            token = token_text(token_id)
            top = {token_text(t): lp for t, lp in sample.top}
            top.setdefault(token, sample.logprob)
            result.tokens.append(token)
            result.token_logprobs.append(sample.logprob)
            result.top_logprobs.append(top)
            result.text_offset.append(offset)
            offset += len(token)
        return result
