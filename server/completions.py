"""POST /v1/completions: prompts (text or token ids, one or several) to completions, as
JSON or as an SSE stream; `echo`, completions-shaped logprobs, `n` choices per prompt.

`echo` puts the prompt before each choice's text (streamed: in the choice's first chunk).
With `logprobs` its tokens are scored too, by the engine's prompt logprobs (so the prompt is
computed whole, whatever the prefix cache holds): lm-eval's `local-completions` sums them.
`max_tokens` 0 with `echo` scores the prompt alone: the engine samples one token to end the
prompt, which the response leaves out (as vLLM does).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response
from orjson import Fragment

from engine.outputs import RequestOutput, RequestStream
from scheduler.output import PromptLogprobs, SampleLogprobs
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

_Part = TypeVar("_Part", Choice, RequestOutput)
_EventOf = Callable[[RequestOutput, CompletionLogprobs | None], Event]


class Completions:
    """The completions route over the shared `Serving`."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def __call__(self, raw: Request) -> Response:
        serving = self.serving
        arrival = time.monotonic()
        body, admitted = await serving.parse(raw, CompletionRequest, arrival)
        # NOTE: max_tokens 0 (echo) samples one token, left out of the response
        max_tokens = max(1, _DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens)
        prompts: list[list[int]] = []
        if isinstance(body.prompts[0], str):
            texts = [str(p) for p in body.prompts]
            for text in texts:  # one by one: the first prompt over a limit ends the work
                serving.check_prompt_chars(text, "prompt", "prompt")
                prompts.append(await serving.in_pool(serving.encode, text, True))
                admitted.num_tokenized += len(prompts[-1])
                serving.check_prompt(prompts[-1], max_tokens)
        else:
            prompts = [list(p) for p in body.prompts]
            for prompt in prompts:
                serving.check_prompt(prompt, max_tokens)
            texts = await serving.in_pool(serving.decode_all, prompts) if body.echo else []
        grammar = await serving.grammar(body)
        params = serving.sampling_params(body, max_tokens, body.logprobs, grammar)
        request_id = random_id("cmpl")
        stream = serving.submit(request_id, prompts, params, body, admitted, arrival)
        echo = texts if body.echo else None
        if body.stream:
            return self._stream(request_id, stream, body, prompts, echo)
        choices = await serving.collect(stream, raw)
        if choices is None:
            return Response(status_code=499)
        if body.scores_prompt_only:
            choices = [_prompt_only(c) for c in choices]
        prompt_logprobs = serving.prompt_logprobs_json(prompts, body.n, body.prompt_logprobs)

        def render() -> bytes:
            response = CompletionResponse(
                id=request_id,
                model=serving.reported_model(body.model),
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
        model = self.serving.reported_model(body.model)
        n = body.n
        num_choices = len(prompts) * n
        # the echoes yet to send, by choice (each in its choice's first chunk)
        unechoed = {i: echo[i // n] for i in range(num_choices)} if echo is not None else {}
        # NOTE: a choice's text starts with its echo, so that its tokens' offsets follow it
        choices = {i: Choice(text=unechoed.get(i, "")) for i in range(num_choices)}
        head = chunk_head(request_id, "text_completion", created, model)
        prompt_logprobs = self.serving.prompt_logprobs_json(prompts, n, body.prompt_logprobs)

        def chunk(choice: CompletionStreamChoice, fragment: Fragment | None = None) -> Event:
            response = CompletionStreamResponse(id=request_id, created=created, model=model,
                                                choices=[choice])
            return model_event(response, fragment)

        def logprobs_of(output: RequestOutput, text_offset: int) -> CompletionLogprobs | None:
            if body.logprobs is None:
                return None
            return self._logprobs(output.token_ids, output.logprobs or [], text_offset)

        def event_of(output: RequestOutput, logprobs: CompletionLogprobs | None) -> Event:
            if logprobs is None and output.prompt_logprobs is None:
                return fast_chunk(head, output, {"text": output.text})
            return chunk(CompletionStreamChoice(
                index=output.index,
                text=output.text,
                logprobs=logprobs,
                finish_reason=output.finish_reason,  # type: ignore[arg-type]
                num_preemptions=output.num_preemptions if output.finished else None,
                slo=output.slo,
            ), prompt_logprobs(output.index, output.prompt_logprobs))

        def usage_event() -> str:
            response = CompletionStreamResponse(
                id=request_id, created=created, model=model, choices=[],
                usage=usage(prompts, list(choices.values())),
            )
            return sse_data(response.model_dump_json())

        outputs = _prompt_only_outputs(stream) if body.scores_prompt_only else stream
        events_of = event_of if echo is None else self._echoing(event_of, unechoed, body, prompts)
        deltas = delta_events(outputs, choices, logprobs_of, events_of, self.serving.off_loop)
        return event_stream(self.serving.engine, stream, (), deltas,
                            usage_event if body.include_usage_in_stream else None)

    def _echoing(
        self,
        event_of: _EventOf,
        unechoed: dict[int, str],
        body: CompletionRequest,
        prompts: list[list[int]],
    ) -> _EventOf:
        """`event_of`, with each choice's first chunk carrying its prompt, the choice's
        entry of `unechoed` (and with logprobs, the prompt's)."""

        def echo_event_of(output: RequestOutput, logprobs: CompletionLogprobs | None) -> Event:
            prefix = unechoed.pop(output.index, None)
            if prefix is None:
                return event_of(output, logprobs)
            if body.logprobs is not None:
                logprobs = self._echo_logprobs(prompts[output.index // body.n],
                                               output.prompt_logprobs, body.logprobs, logprobs)
            return event_of(replace(output, text=prefix + output.text), logprobs)

        return echo_event_of

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
            logprobs = self._logprobs(choice.token_ids, choice.logprobs, len(prefix))
            if echo is not None:
                logprobs = self._echo_logprobs(prompt, choice.prompt_logprobs, body.logprobs,
                                               logprobs)
        return CompletionChoice(
            index=index,
            text=prefix + choice.text,
            logprobs=logprobs,
            finish_reason=choice.finish_reason,  # type: ignore[arg-type]
            num_preemptions=choice.num_preemptions,
            slo=choice.slo,
        )

    def _echo_logprobs(
        self,
        prompt: list[int],
        prompt_logprobs: PromptLogprobs | None,
        num_top: int,
        generated: CompletionLogprobs | None,
    ) -> CompletionLogprobs | None:
        """The echoed prompt's logprobs (offsets from 0; its first token has none), then
        `generated`. When the prompt logprobs did not come (the request ended before its
        prompt was computed: its deadline, an abort) the prompt has no entries at all:
        only `generated` (NOTE: not a null per prompt token, each token's text written on
        the event loop, for a prompt that never ran)."""
        if prompt_logprobs is None:
            return generated
        samples: list[SampleLogprobs | None] = [None] * len(prompt)
        for i, (logprob, top) in enumerate(
            zip(prompt_logprobs.logprobs, prompt_logprobs.top, strict=True)
        ):
            samples[prompt_logprobs.start + i] = SampleLogprobs(logprob, top[:num_top])
        result = self._logprobs(prompt, samples, 0)
        if generated is not None:
            result.tokens += generated.tokens
            result.token_logprobs += generated.token_logprobs
            result.top_logprobs += generated.top_logprobs
            result.text_offset += generated.text_offset
        return result

    def _logprobs(
        self,
        token_ids: list[int],
        samples: Sequence[SampleLogprobs | None],
        text_offset: int,
    ) -> CompletionLogprobs:
        """Completions-shaped logprobs of `token_ids` from `text_offset` on: each token's
        logprob and its top alternatives with the token itself (None where it has none)."""
        token_text = self.serving.token_text
        result = CompletionLogprobs()
        offset = text_offset
        for token_id, sample in zip(token_ids, samples, strict=False):
            token = token_text(token_id)
            result.tokens.append(token)
            result.text_offset.append(offset)
            offset += len(token)
            if sample is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            top = {token_text(t): lp for t, lp in sample.top}
            top.setdefault(token, sample.logprob)
            result.token_logprobs.append(sample.logprob)
            result.top_logprobs.append(top)
        return result


def _prompt_only(part: _Part) -> _Part:
    """A choice (or one of its outputs) of max_tokens 0, the prompt scored alone: the one
    token sampled to end the prompt left out; a choice that stopped on it ends at its
    length, as asked."""
    finish_reason = "length" if part.finish_reason == "stop" else part.finish_reason
    return replace(part, text="", token_ids=[], logprobs=[], num_output_tokens=0,
                   finish_reason=finish_reason)


async def _prompt_only_outputs(stream: RequestStream) -> AsyncIterator[RequestOutput]:
    """The outputs of `stream` with max_tokens 0 (`_prompt_only`)."""
    async for output in stream:
        yield _prompt_only(output)
