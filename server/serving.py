"""What the two generation routes share after admission (server/admission.py, which
`Serving` extends): tokenizing and chat templates off the event loop, the output grammar,
submitting to the engine, gathering a non-streamed result, and writing a response with
logprobs off the event loop (server/rendering.py writes the JSON).

Limits checked with the work: the prompt's tokens against the context (as it is
tokenized), the nesting of tool calls' arguments in the messages (before the chat template
parses them), the chat template's time (server/chat_template.py), the grammar's budgets and
compile time, the prompt_logprobs entries and the tenant's exact token charge: each a 400
(429 for the charge) naming the limit. The tenant's seat passes to the engine with the
request (`submit`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Request

from engine.client import EngineClient
from engine.data_parallel import DataParallelEngine
from engine.outputs import EngineDeadError, EngineStepError, RequestStream
from engine.request import EngineRequest
from scheduler.sampling_params import SamplingParams
from server.admission import Admission, Admitted
from server.chat_template import apply_chat_template
from server.config import ServerConfig
from server.errors import APIError, server_error
from server.limits import check_prompt_logprobs, over_limit
from server.rendering import Choice, PromptLogprobsJSON
from server.requests import ChatCompletionRequest, SamplingRequest
from server.structured_output import Constraint, GrammarError, json_depth, request_grammar
from server.tenants import TenantRefused
from structured.compiler import GrammarCompiler

_T = TypeVar("_T")

_RENDER_THREADS = 2  # responses with logprobs written at once, off the event loop


class Serving(Admission):
    """Admission, tokenization and engine access of the generation routes (one per app)."""

    def __init__(self, engine: EngineClient | DataParallelEngine, config: ServerConfig) -> None:
        super().__init__(engine, config)
        # NOTE: one tokenizer for the event loop, the tokenizer thread and the render
        # threads: it is read-only (model_runner/text_tokenizer.py)
        self.tokenizer = engine.info.tokenizer
        # NOTE: tokenizing and chat templates run off the event loop, so that a huge prompt
        # stalls no other stream nor /health
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        # NOTE: the JSON of a response with logprobs is written off the event loop too
        # (`render`): prompt logprobs of n choices can be tens of megabytes.
        self._render_pool = concurrent.futures.ThreadPoolExecutor(
            _RENDER_THREADS, thread_name_prefix="render"
        )
        # NOTE: grammars compile (and compute their first mask) on threads of their own, not
        # the tokenizer's: a slow grammar delays no prompt.
        grammar_tokenizer = engine.info.grammar_tokenizer
        self.grammars = (None if grammar_tokenizer is None
                         else GrammarCompiler(grammar_tokenizer, num_threads=2))

    async def in_pool(self, fn: Callable[..., _T], *args: Any) -> _T:
        """`fn(*args)` on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    @staticmethod
    def sampling_params(
        body: SamplingRequest, max_tokens: int, logprobs: int | None, grammar: str | None
    ) -> SamplingParams:
        try:
            return body.to_sampling_params(max_tokens, logprobs, grammar)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    async def grammar(
        self, body: SamplingRequest, forced_tool: Callable[[], str | None] | None = None
    ) -> str | None:
        """The request's output grammar (server/structured_output.py; `forced_tool` builds
        a forced tool call's), within the grammar budgets and checked on the tokenizer
        thread, then compiled for the model's tokenizer with its first mask; a 400 naming
        why it cannot be."""
        try:
            constraint = await self.in_pool(request_grammar, body, self.config.limits,
                                            forced_tool)
        except GrammarError as exc:
            raise APIError(400, str(exc), param=exc.param) from exc
        if constraint is None:
            return None
        if self.grammars is None:
            raise APIError(400, "Structured outputs and forced tool calls are not available "
                           "on this server (its tokenizer is not one llguidance reads).")
        await self._compile(self.grammars, constraint)
        return constraint.grammar

    async def _compile(self, grammars: GrammarCompiler, constraint: Constraint) -> None:
        """Compile the grammar and compute its first mask (cached by grammar) within
        --grammar-timeout-s; a 400 when it fails or takes longer (the compile then runs on,
        within llguidance's limits, and stays cached)."""
        limit = self.config.limits.grammar_timeout_s
        compiled = asyncio.wrap_future(grammars.compile(constraint.grammar))
        done, _ = await asyncio.wait({compiled}, timeout=limit)
        param = constraint.param
        if not done:
            compiled.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise APIError(400, f"{param}: " + over_limit(
                "the grammar took too long to compile and compute its first token mask",
                limit, "grammar_timeout_s"), param=param)
        error = compiled.exception()
        if error is not None:
            raise APIError(400, f"{param}: {error}", param=param) from error

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """On the tokenizer thread."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode_all(self, prompts: list[list[int]]) -> list[str]:
        """On the tokenizer thread."""
        return [str(self.tokenizer.decode(p)) for p in prompts]

    def render_chat(
        self, body: ChatCompletionRequest, add_generation_prompt: bool = True
    ) -> list[int]:
        """The messages (and tools) through the chat template (server/chat_template.py), as
        tokens; on the tokenizer thread. A 400 also when the text is surely too long."""
        check_tool_arguments(body, self.config.limits.max_tool_arguments_depth)
        text = apply_chat_template(self.tokenizer, body, self.config, add_generation_prompt)
        self.check_prompt_chars(text, "rendered chat", "messages")
        return self.encode(text, add_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """One token's text (on the event loop or a render thread: decoding only reads the
        tokenizer)."""
        return str(self.tokenizer.decode([token_id]))

    def prompt_logprobs_json(
        self, prompts: list[list[int]], n: int, num_top: int | None
    ) -> PromptLogprobsJSON:
        """The writer of a request's prompt logprobs (`n` choices per prompt, the top
        `num_top` of each token: the request's `prompt_logprobs`)."""
        return PromptLogprobsJSON(self.token_text, prompts, n, num_top)

    async def render(self, params: SamplingParams, build: Callable[[], _T]) -> _T:
        """`build()` (a response's JSON): on the event loop when the request asked for no
        logprobs, else on a render thread, as its JSON can be megabytes."""
        if params.logprobs is None and params.prompt_logprobs is None:
            return build()
        return await self.off_loop(build)

    async def off_loop(self, fn: Callable[..., _T], *args: Any) -> _T:
        """`fn(*args)` on a render thread (NOTE: not the tokenizer's, so that a large
        response waits for no tokenizing, nor a prompt for a large response)."""
        return await asyncio.get_running_loop().run_in_executor(self._render_pool, fn, *args)

    # ------------------------------------------------------ engine

    def submit(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        body: SamplingRequest,
        admitted: Admitted,
        arrival: float,
    ) -> RequestStream:
        """Into the engine, once its prompt_logprobs entries are within their budget (400)
        and the tenant's token rate has room for its exact tokens (429); the engine holds
        the tenant's seat from then on and releases it when the request ends."""
        check_prompt_logprobs(prompts, body, self.config.limits)
        asked = sum(len(p) for p in prompts) + params.max_tokens * len(prompts) * body.n
        try:
            admitted.seat.charge(asked)
        except TenantRefused as exc:
            raise self._refused(admitted.tenant, exc) from exc
        request = EngineRequest(
            request_id, prompts, params, n=body.n, stop=body.stop_strings,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            placement=admitted.placement, arrival_time=arrival,
        )
        try:
            stream = self.engine.add_request(request, on_done=admitted.seat.release)
        except EngineDeadError as exc:
            raise server_error(503, str(exc)) from exc
        admitted.submitted = True
        return stream

    async def collect(self, stream: RequestStream, raw: Request) -> list[Choice] | None:
        """Every choice's full output; None when the client went away first (aborted)."""

        async def gather() -> list[Choice]:
            choices: dict[int, Choice] = {}
            async for output in stream:
                choices.setdefault(output.index, Choice()).add(output)
            return [choices[i] for i in sorted(choices)]

        gather_task = asyncio.ensure_future(gather())
        disconnect_task = asyncio.ensure_future(_wait_for_disconnect(raw))
        try:
            await asyncio.wait({gather_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED)
            if not gather_task.done():
                return None
            choices = gather_task.result()
        except EngineStepError as exc:
            if exc.status_code == 400:
                raise APIError(400, str(exc)) from exc
            raise server_error(500, str(exc)) from exc
        finally:
            for task in (gather_task, disconnect_task):
                task.cancel()
            if not stream.finished:
                self.engine.abort(stream.request_id)
        if all(c.finish_reason == "rejected" for c in choices):
            raise server_error(
                503, "The first token could no longer be within slo.ttft_ms, and the request "
                "asked on_miss: reject. Retry later or elsewhere.", code="slo_unattainable",
                headers={"Retry-After": str(self.config.retry_after_s)})
        if all(c.finish_reason == "deadline" and not c.num_output_tokens for c in choices):
            raise APIError(504, "The request's deadline passed before it was computed.",
                           type="timeout_error", code="deadline_exceeded")
        return choices


def check_tool_arguments(body: ChatCompletionRequest, limit: int) -> None:
    """A 400 naming --max-tool-arguments-depth when a tool call's arguments in the messages
    (JSON text, or a JSON value) nest deeper than `limit`: measured without recursion,
    before the chat template parses and renders them (whose recursion would fail)."""
    for message in body.messages:
        calls = (message.model_extra or {}).get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                continue
            if _arguments_depth(function.get("arguments"), limit) <= limit:
                continue
            raise APIError(400, over_limit(
                f"the arguments of tool call {str(call.get('id', ''))[:64]!r} nest deeper "
                f"than {limit} levels", limit, "max_tool_arguments_depth"), param="messages")


def _arguments_depth(arguments: Any, limit: int) -> int:
    """How deep `arguments` (JSON text, else a parsed value) nest; over `limit` when too
    deep to parse."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except RecursionError:
            return limit + 1
        except ValueError:
            return 0  # no JSON: the template takes it as text
    return json_depth(arguments, limit)


async def _wait_for_disconnect(raw: Request) -> None:
    """Returns when the client closes the connection (the body was already read)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return
