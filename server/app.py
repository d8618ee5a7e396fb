"""The HTTP front end: OpenAI-compatible routes over an Engine.

Routes: POST /v1/completions, POST /v1/chat/completions (JSON or SSE streams ending in
`data: [DONE]`), GET /v1/models, /health, /metrics, /scheduler/state, and the utility
routes of server/utility_routes.py (/tokenize, /detokenize, /version). Every error has
OpenAI's shape `{"error": {"message", "type", "param", "code"}}`; invalid requests (bad
JSON and schema errors included) are 400, never 422. Bodies are parsed here rather than
by FastAPI so that a missing or wrong Content-Type is no error and the checks run in a
fixed order: key, body size, JSON, schema, model, priority, load, context length; the
OpenAPI schema still documents the request models (`openapi_extra`).

Limits that keep one request from taking the server down: the body size (413), the JSON
nesting depth and integer size, the protocol's bounds on every field and list (n, prompts
x n, stop strings, stop token ids, logprobs, messages), the prompt's characters (checked
before tokenizing, so that a huge prompt costs no tokenizer time) and tokens against the
context, and prompt plus max_tokens against the context: each is a 400 naming the limit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import hmac
import json
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
import pydantic
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scheduler.output import SampleLogprobs
from scheduler.sampling_params import SamplingParams
from server.chat_output import (
    ChatOutputParser,
    chat_output_parser,
    forced_tool_grammar,
    tool_parser_for,
)
from server.config import ServerConfig
from server.engine import Engine, EngineDeadError, EngineStepError, RequestOutput, RequestStream
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
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    SamplingRequest,
    UsageInfo,
    random_id,
)
from server.structured_output import GrammarError, request_grammar
from server.tool_parsers import ToolParser
from server.utility_routes import RequestIdMiddleware, install_utility_routes

_OPEN_PATHS = frozenset({"/health", "/metrics"})
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DEFAULT_COMPLETION_MAX_TOKENS = 16
# A JSON escape of a UTF-16 surrogate: the parsed strings may hold an unpaired one.
_SURROGATE_ESCAPE_RE = re.compile(rb"\\u[dD][89a-fA-F]")
# After the grace period the engine aborts what is left; handlers then need a moment to
# send their last chunk before uvicorn cuts the connections.
_ABORT_FLUSH_S = 2.0

_RequestT = TypeVar("_RequestT", bound=SamplingRequest)
_T = TypeVar("_T")


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=self.info).model_dump()
        return JSONResponse(body, status_code=self.status_code, headers=self.headers)


def _error_type(status_code: int) -> str:
    return "invalid_request_error" if status_code < 500 else "server_error"


# ------------------------------------------------------------------ middleware


class _ApiKeyMiddleware:
    """401 for every path but /health and /metrics without `Authorization: Bearer <key>`.

    The key is compared in constant time (hmac.compare_digest) and never logged.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    def _authorized(self, scope: Scope) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        # NOTE: compare_digest runs whatever the scheme, so that timing tells nothing.
        key_matches = hmac.compare_digest(token.strip(), self._key)
        return scheme.lower() == b"bearer" and key_matches

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS:
            if not self._authorized(scope):
                error = APIError(
                    401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyLimitMiddleware:
    """413 for request bodies over max_bytes, by Content-Length or as they stream in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self._max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self._max_bytes:
            await self._too_large().response()(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self._max_bytes:
                    raise self._too_large()
            return message

        await self.app(scope, limited_receive, send)

    def _too_large(self) -> APIError:
        return APIError(
            413, f"Request body is larger than {self._max_bytes} bytes.",
            code="request_too_large",
        )


class _BodyTimeoutMiddleware:
    """408 when a request body has not fully arrived within timeout_s (a client that
    sends its body slowly, or not at all, holds no handler for long)."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self._timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = time.monotonic() + self._timeout_s
        body_done = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                async with asyncio.timeout_at(_loop_deadline(deadline)):
                    message = await receive()
            except TimeoutError:
                raise APIError(
                    408, f"The request body did not arrive within {self._timeout_s:g} s.",
                    code="request_timeout",
                ) from None
            body_done = message["type"] != "http.request" or not message.get("more_body")
            return message

        await self.app(scope, timed_receive, send)


def _loop_deadline(monotonic_deadline: float) -> float:
    """A time.monotonic() deadline on the running loop's clock."""
    loop = asyncio.get_running_loop()
    return loop.time() + (monotonic_deadline - time.monotonic())


# ------------------------------------------------------------------ the app


def build_app(engine: Engine, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving `engine`; its lifespan starts and stops the engine."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="pagedserve", lifespan=lifespan)
    app.add_middleware(_BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    app.add_middleware(_BodyTimeoutMiddleware, timeout_s=config.body_timeout_s)
    if config.api_key is not None:
        app.add_middleware(_ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(RequestIdMiddleware)
    _install_error_handlers(app)
    _install_openapi(app, [CompletionRequest, ChatCompletionRequest])
    api = _OpenAIServing(engine, config)

    @app.post("/v1/completions", response_model=None,
              openapi_extra=_json_request_body(CompletionRequest),
              responses=_generation_responses(CompletionResponse, CompletionStreamResponse))
    async def completions(request: Request) -> Response:
        return await api.completions(request)

    @app.post("/v1/chat/completions", response_model=None,
              openapi_extra=_json_request_body(ChatCompletionRequest),
              responses=_generation_responses(ChatCompletionResponse, ChatCompletionChunk))
    async def chat_completions(request: Request) -> Response:
        return await api.chat_completions(request)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, max_model_len=engine.info.max_model_len)
                               for name in api.model_names])

    install_utility_routes(app, api)

    @app.get("/health")
    async def health() -> dict[str, str]:
        if not engine.is_alive:
            raise APIError(503, f"The engine is not serving: {engine.unavailable_reason()}.",
                           type="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/scheduler/state")
    async def scheduler_state(check: int = 0) -> dict[str, Any]:
        """The scheduler's state; with `check=1` also its integrity check's verdict."""
        try:
            return await engine.snapshot(bool(check), timeout_s=config.snapshot_timeout_s)
        except EngineDeadError as exc:
            raise APIError(503, f"The engine is not serving: {exc}.", type="server_error") from exc

    return app


class GracefulServer(uvicorn.Server):
    """uvicorn's server, with a shutdown (SIGTERM) that lets in-flight requests run for
    `grace_s`, then aborts what is left in the engine, so that every client still gets a
    well-formed end (finish_reason "abort", then `data: [DONE]` on a stream) before
    uvicorn closes the connections, `_ABORT_FLUSH_S` later."""

    def __init__(self, app: FastAPI, engine: Engine, config: ServerConfig) -> None:
        super().__init__(uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            timeout_graceful_shutdown=config.shutdown_grace_s + _ABORT_FLUSH_S,
            limit_concurrency=config.limit_concurrency,
        ))
        self._engine = engine
        self._grace_s = config.shutdown_grace_s

    async def shutdown(self, sockets: Any = None) -> None:
        abort = asyncio.get_running_loop().call_later(self._grace_s, self._engine.abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            abort.cancel()


# ------------------------------------------------------------------ OpenAPI


def _json_request_body(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    """`openapi_extra` documenting a JSON body of `model` (parsed by hand, see the top)."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _generation_responses(
    response: type[pydantic.BaseModel], chunk: type[pydantic.BaseModel]
) -> dict[int | str, dict[str, Any]]:
    """The answers of a generation route: the response, or an SSE stream of `chunk` objects
    ending in `data: [DONE]`, or an error in OpenAI's shape."""
    # One server-sent event: a chunk, an error (then the end), or the final [DONE].
    event_data = {"anyOf": [
        {"type": "string", "const": "[DONE]"},
        {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [
            {"$ref": f"#/components/schemas/{chunk.__name__}"},
            {"$ref": "#/components/schemas/ErrorResponse"},
        ]}},
    ]}
    event = {"type": "object", "required": ["data"], "properties": {"data": event_data}}
    stream = {"schema": event}
    responses: dict[int | str, dict[str, Any]] = {
        200: {
            "model": response,
            "description": "The completion, or with `stream` a text/event-stream of chunks.",
            "content": {"text/event-stream": stream},
        },
    }
    for status, why in ((400, "Invalid request"), (401, "Missing or wrong API key"),
                        (404, "Unknown model"), (413, "Request body too large"),
                        (500, "A step of the engine failed"),
                        (503, "Engine not running, or too many requests waiting")):
        responses[status] = {"model": ErrorResponse, "description": why}
    return responses


def _install_openapi(app: FastAPI, request_models: Sequence[type[pydantic.BaseModel]]) -> None:
    """Add the request models (and the chunk models) to the schema's components."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            models = [
                *((m, "validation") for m in request_models),
                (CompletionStreamResponse, "serialization"),
                (ChatCompletionChunk, "serialization"),
            ]
            _, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, definition in defs.get("$defs", {}).items():
                components.setdefault(name, definition)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc.errors()).response()

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        # NOTE: Starlette re-raises after this response, so the server logs the traceback.
        return APIError(500, f"Internal server error: {exc!r}", type="server_error").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = APIError(exc.status_code, str(exc.detail), type=_error_type(exc.status_code))
        return error.response()


def _validation_error(errors: Sequence[Any]) -> APIError:
    """One 400 naming every invalid field."""
    parts, param = [], None
    for error in errors:
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        message = str(error.get("msg", "")).removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
        if param is None and loc:
            param = loc[0]
    return APIError(400, "; ".join(parts) or "Invalid request.", param=param)


class _EventStreamResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator, so that the generator's
    `finally` (which aborts the request) runs even when the client went away while a
    chunk was being sent rather than while the generator was waiting for one."""

    body_iterator: AsyncGenerator[str | bytes, None]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


@dataclass
class _Choice:
    """A choice's text, tokens and logprobs gathered from its outputs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampleLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


class _OpenAIServing:
    """Validation, tokenization and response shaping of the two generation routes."""

    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = engine.info.tokenizer  # the event loop's (logprob tokens)
        self.max_prompt_chars = _max_prompt_chars(self.tokenizer, engine.info.max_model_len)
        # NOTE: tokenizing and chat templates run off the event loop, so that a huge prompt
        # stalls no other stream nor /health; one thread with its own copy of the
        # tokenizer, as a fast tokenizer is not thread-safe.
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._pool_tokenizer = copy.deepcopy(self.tokenizer)
        self.model_names = (engine.info.model_name, *config.model_aliases)

    async def _in_pool(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # -------------------------------------------------------------- routes

    async def completions(self, raw: Request) -> Response:
        arrival = time.monotonic()
        body = await self._parse(raw, CompletionRequest)
        self._check_admission(body)
        max_tokens = body.max_tokens or _DEFAULT_COMPLETION_MAX_TOKENS
        prompts: list[list[int]] = []
        if isinstance(body.prompts[0], str):
            texts = [str(p) for p in body.prompts]
            for text in texts:  # one by one: the first prompt over a limit ends the work
                self._check_prompt_chars(text, "prompt", "prompt")
                prompts.append(await self._in_pool(self._encode, text, True))
                self._check_prompt(prompts[-1], max_tokens)
        else:
            prompts = [list(p) for p in body.prompts]
            for prompt in prompts:
                self._check_prompt(prompt, max_tokens)
            texts = await self._in_pool(self._decode_all, prompts) if body.echo else []
        grammar = await self._grammar(body)
        params = self._sampling_params(body, max_tokens, body.logprobs, grammar)
        request_id = random_id("cmpl")
        stream = self._submit(request_id, prompts, params, body, arrival)
        echo = texts if body.echo else None
        if body.stream:
            return self._sse(self._completion_events(request_id, stream, body, prompts, echo))
        choices = await self._collect(stream, raw)
        if choices is None:
            return Response(status_code=499)
        return _json_response(CompletionResponse(
            id=request_id,
            model=self.engine.info.model_name,
            choices=[
                self._completion_choice(i, c, body, prompts[i // body.n], echo)
                for i, c in enumerate(choices)
            ],
            usage=_usage(prompts, choices),
        ))

    async def chat_completions(self, raw: Request) -> Response:
        arrival = time.monotonic()
        body = await self._parse(raw, ChatCompletionRequest)
        self._check_admission(body)
        tool_parser = self._tool_parser(body)
        prompt = await self._in_pool(self._render_chat, body)
        self._check_prompt(prompt, body.requested_max_tokens or 0)
        max_tokens = body.requested_max_tokens or self.engine.info.max_model_len - len(prompt)
        grammar = await self._grammar(body, forced_tool_grammar(body, tool_parser))
        params = self._sampling_params(body, max_tokens, body.num_logprobs, grammar)
        request_id = random_id("chatcmpl")
        stream = self._submit(request_id, [prompt], params, body, arrival)
        if body.stream:
            return self._sse(self._chat_events(request_id, stream, body, prompt, tool_parser))
        choices = await self._collect(stream, raw)
        if choices is None:
            return Response(status_code=499)
        return _json_response(ChatCompletionResponse(
            id=request_id,
            model=self.engine.info.model_name,
            choices=[
                self._chat_choice(i, c, body, self._output_parser(body, tool_parser))
                for i, c in enumerate(choices)
            ],
            usage=_usage([prompt], choices),
        ))

    def _chat_choice(
        self, index: int, c: _Choice, body: ChatCompletionRequest,
        parser: ChatOutputParser | None,
    ) -> ChatCompletionChoice:
        message = ChatResponseMessage(content=c.text)
        finish_reason = c.finish_reason
        if parser is not None:
            parsed = parser.parse(c.text)
            message = ChatResponseMessage(content=parsed.content,
                                          reasoning_content=parsed.reasoning,
                                          tool_calls=parsed.tool_calls or None)
            if parsed.tool_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        return ChatCompletionChoice(
            index=index,
            message=message,
            logprobs=self._chat_logprobs(c.token_ids, c.logprobs) if body.logprobs else None,
            finish_reason=finish_reason,  # type: ignore[arg-type]
            num_preemptions=c.num_preemptions,
        )

    def _tool_parser(self, body: ChatCompletionRequest) -> ToolParser | None:
        try:
            return tool_parser_for(body, self.config.tool_call_parser)
        except ValueError as exc:
            raise APIError(400, str(exc), param="tool_choice") from exc

    def _output_parser(
        self, body: ChatCompletionRequest, tool_parser: ToolParser | None
    ) -> ChatOutputParser | None:
        return chat_output_parser(body, tool_parser, self.config.reasoning_parser)

    async def _grammar(self, body: SamplingRequest, tool_grammar: str | None = None) -> str | None:
        """The request's output grammar, built and checked on the tokenizer thread."""
        try:
            grammar = await self._in_pool(request_grammar, body, tool_grammar)
        except GrammarError as exc:
            raise APIError(400, str(exc), param=exc.param) from exc
        if grammar is not None and not self.engine.info.structured_outputs:
            raise APIError(400, "Structured outputs and forced tool calls are not available "
                           "on this server (its tokenizer is not one llguidance reads).")
        return grammar

    # ------------------------------------------------------ validation

    async def _parse(self, raw: Request, model: type[_RequestT]) -> _RequestT:
        body = await raw.body()
        try:
            data = json.loads(body)
        except RecursionError as exc:
            raise APIError(400, "Request body is not valid JSON: nested too deeply.") from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"Request body is not valid JSON: {exc}") from exc
        except ValueError as exc:  # an integer of more than 4300 digits
            raise APIError(400, "Request body is not valid JSON: a number is too long.") from exc
        if not isinstance(data, dict):
            raise APIError(400, "Request body must be a JSON object.")
        if _SURROGATE_ESCAPE_RE.search(body) and _has_lone_surrogate(data):
            raise APIError(
                400, "Request body is not valid JSON: a string holds an unpaired UTF-16 "
                "surrogate (\\ud800-\\udfff), which is no Unicode character."
            )
        try:
            return model.model_validate(data)
        except pydantic.ValidationError as exc:
            raise _validation_error(exc.errors(include_url=False)) from exc

    def _check_admission(self, body: SamplingRequest) -> None:
        info = self.engine.info
        if body.model is not None and body.model not in self.model_names:
            raise APIError(
                404, f"The model `{body.model}` does not exist; this server serves "
                f"`{info.model_name}`.", param="model", code="model_not_found",
            )
        if body.priority != 0 and info.policy != "priority":
            raise APIError(
                400, f"priority is not supported under the {info.policy} scheduling policy: "
                "start the server with `--scheduling-policy priority`.", param="priority",
            )
        if not self.engine.is_alive:
            raise APIError(503, f"The engine is not serving: {self.engine.unavailable_reason()}.",
                           type="server_error")
        vocab_size = info.vocab_size
        bad_ids = [t for t in body.token_ids_to_check if t >= vocab_size]
        if bad_ids:
            raise APIError(
                400, f"token id {bad_ids[0]} (in stop_token_ids, logit_bias or "
                f"allowed_token_ids) is out of range: the vocabulary has {vocab_size} tokens.",
                param="stop_token_ids" if bad_ids[0] in (body.stop_token_ids or ()) else None,
            )
        limit = self.config.max_waiting
        if limit is not None and self.engine.num_waiting >= limit:
            raise APIError(
                503, f"The server is overloaded: {limit} requests are waiting. Retry later.",
                type="server_error", code="server_overloaded",
                headers={"Retry-After": str(self.config.retry_after_s)},
            )

    def _check_prompt_chars(self, text: str, what: str, param: str) -> None:
        """400 for a text that surely has more tokens than the context, before tokenizing
        it (which takes seconds for megabytes)."""
        limit = self.max_prompt_chars
        if limit is not None and len(text) > limit:
            raise APIError(
                400, f"This model's maximum context length is {self.engine.info.max_model_len} "
                f"tokens, at most {limit} characters of text. However, your {what} is "
                f"{len(text)} characters long. Please reduce the length of the {param}.",
                param=param,
            )

    def _check_prompt(self, prompt: list[int], max_tokens: int) -> None:
        info = self.engine.info
        if not prompt:
            raise APIError(400, "The prompt is empty.", param="prompt")
        bad = [t for t in prompt if t >= info.vocab_size]
        if bad:
            raise APIError(
                400, f"Token id {bad[0]} is out of range: the vocabulary has "
                f"{info.vocab_size} tokens.", param="prompt",
            )
        limit = info.max_model_len
        if len(prompt) >= limit:
            raise APIError(
                400, f"This model's maximum context length is {limit} tokens. However, your "
                f"request has {len(prompt)} input tokens, which leaves no room for output. "
                "Please reduce the length of the input.", param="prompt",
            )
        if len(prompt) + max_tokens > limit:
            raise APIError(
                400, f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, "
                f"{max_tokens} in the completion). Please reduce the length of the prompt "
                "or of max_tokens.", param="max_tokens",
            )

    def _sampling_params(
        self, body: SamplingRequest, max_tokens: int, logprobs: int | None, grammar: str | None
    ) -> SamplingParams:
        try:
            return body.to_sampling_params(max_tokens, logprobs, grammar)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """On the tokenizer thread."""
        return list(self._pool_tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _decode_all(self, prompts: list[list[int]]) -> list[str]:
        """On the tokenizer thread."""
        return [str(self._pool_tokenizer.decode(p)) for p in prompts]

    def _render_chat(
        self, body: ChatCompletionRequest, add_generation_prompt: bool = True
    ) -> list[int]:
        """On the tokenizer thread."""
        messages = [m.to_template_dict() for m in body.messages]
        kwargs = dict(body.chat_template_kwargs or {})
        if body.effective_tool_choice != "none" and body.tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
        if self.config.chat_template is not None:
            kwargs["chat_template"] = self.config.chat_template
        try:
            text = self._pool_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except Exception as exc:  # jinja errors: the messages do not fit the template
            raise APIError(400, f"Cannot apply the chat template: {exc}", param="messages") from exc
        self._check_prompt_chars(text, "rendered chat", "messages")
        return self._encode(text, add_special_tokens=False)

    # ------------------------------------------------------ engine

    def _submit(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        body: SamplingRequest,
        arrival: float,
    ) -> RequestStream:
        try:
            return self.engine.add_request(
                request_id, prompts, params, n=body.n, stop=body.stop_strings,
                priority=body.priority, arrival_time=arrival,
                skip_special_tokens=body.skip_special_tokens,
                include_stop_str_in_output=body.include_stop_str_in_output,
            )
        except EngineDeadError as exc:
            raise APIError(503, str(exc), type="server_error") from exc

    async def _collect(self, stream: RequestStream, raw: Request) -> list[_Choice] | None:
        """Every choice's full output; None when the client went away first (aborted)."""

        async def gather() -> list[_Choice]:
            choices: dict[int, _Choice] = {}
            async for output in stream:
                _accumulate(choices.setdefault(output.index, _Choice()), output)
            return [choices[i] for i in sorted(choices)]

        gather_task = asyncio.ensure_future(gather())
        disconnect_task = asyncio.ensure_future(_wait_for_disconnect(raw))
        try:
            await asyncio.wait({gather_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED)
            if not gather_task.done():
                return None
            return gather_task.result()
        except EngineStepError as exc:
            raise APIError(500, str(exc), type="server_error") from exc
        finally:
            for task in (gather_task, disconnect_task):
                task.cancel()
            if not stream.finished:
                self.engine.abort(stream.request_id)

    # ------------------------------------------------------ streaming

    def _sse(self, events: AsyncGenerator[str | bytes, None]) -> StreamingResponse:
        return _EventStreamResponse(events, media_type="text/event-stream",
                                    headers=_SSE_HEADERS)

    async def _stream_guard(
        self, stream: RequestStream, events: AsyncIterator[str | bytes]
    ) -> AsyncGenerator[str | bytes, None]:
        """Ends every stream with [DONE] (after an error event on failure) and aborts the
        request when the client goes away mid-stream."""
        try:
            async for event in events:
                yield event
        except EngineStepError as exc:
            error = ErrorResponse(error=ErrorInfo(message=str(exc), type="server_error"))
            yield _sse_data(error.model_dump_json())
        finally:
            if not stream.finished:
                self.engine.abort(stream.request_id)
        yield "data: [DONE]\n\n"

    def _completion_events(
        self,
        request_id: str,
        stream: RequestStream,
        body: CompletionRequest,
        prompts: list[list[int]],
        echo: list[str] | None,
    ) -> AsyncGenerator[str | bytes, None]:
        created = int(time.time())
        model = self.engine.info.model_name

        async def events() -> AsyncIterator[str | bytes]:
            choices: dict[int, _Choice] = {}
            for i in range(len(prompts) * body.n):
                choices[i] = _Choice()
                if echo is not None:
                    text, logprobs = echo[i // body.n], None
                    if body.logprobs is not None:
                        logprobs = self._completion_logprobs(prompts[i // body.n], [], [], 0)
                    choices[i].text = text
                    choice = CompletionStreamChoice(index=i, text=text, logprobs=logprobs)
                    yield self._completion_chunk(request_id, created, model, choice)
            head = _chunk_head(request_id, "text_completion", created, model)
            async for output in stream:
                state = choices[output.index]
                offset = len(state.text)
                _accumulate(state, output)
                logprobs = None
                if body.logprobs is not None and output.token_ids:
                    logprobs = self._completion_logprobs(
                        [], output.token_ids, output.logprobs or [], offset
                    )
                if not output.text and logprobs is None and not output.finished:
                    continue
                if logprobs is None:
                    yield _fast_chunk(head, output, {"text": output.text})
                    continue
                choice = CompletionStreamChoice(
                    index=output.index,
                    text=output.text,
                    logprobs=logprobs,
                    finish_reason=output.finish_reason,  # type: ignore[arg-type]
                    num_preemptions=output.num_preemptions if output.finished else None,
                )
                yield self._completion_chunk(request_id, created, model, choice)
            if body.include_usage_in_stream:
                usage = CompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[],
                    usage=_usage(prompts, list(choices.values())),
                )
                yield _sse_data(usage.model_dump_json())

        return self._stream_guard(stream, events())

    @staticmethod
    def _completion_chunk(
        request_id: str, created: int, model: str, choice: CompletionStreamChoice
    ) -> str:
        chunk = CompletionStreamResponse(id=request_id, created=created, model=model,
                                         choices=[choice])
        return _sse_data(chunk.model_dump_json())

    def _chat_events(
        self,
        request_id: str,
        stream: RequestStream,
        body: ChatCompletionRequest,
        prompt: list[int],
        tool_parser: ToolParser | None = None,
    ) -> AsyncGenerator[str | bytes, None]:
        created = int(time.time())
        model = self.engine.info.model_name
        parsers = {i: self._output_parser(body, tool_parser) for i in range(body.n)}

        def chunk(choice: ChatCompletionStreamChoice) -> str:
            c = ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice])
            return _sse_data(c.model_dump_json())

        async def events() -> AsyncIterator[str | bytes]:
            choices = {i: _Choice() for i in range(body.n)}
            for i in range(body.n):
                yield chunk(ChatCompletionStreamChoice(
                    index=i, delta=DeltaMessage(role="assistant", content="")
                ))
            head = _chunk_head(request_id, "chat.completion.chunk", created, model)
            async for output in stream:
                _accumulate(choices[output.index], output)
                logprobs = None
                if body.logprobs and output.token_ids:
                    logprobs = self._chat_logprobs(output.token_ids, output.logprobs or [])
                if not output.text and logprobs is None and not output.finished:
                    continue
                parser = parsers[output.index]
                if logprobs is None and parser is None:
                    delta = {"content": output.text} if output.text else {}
                    yield _fast_chunk(head, output, {"delta": delta})
                    continue
                finish_reason = output.finish_reason
                if parser is None:
                    message = DeltaMessage(content=output.text or None)
                else:
                    message = parser.feed(output.text, output.finished)
                    if finish_reason == "stop" and parser.called_tools:
                        finish_reason = "tool_calls"
                    if message == DeltaMessage() and logprobs is None and not output.finished:
                        continue
                yield chunk(ChatCompletionStreamChoice(
                    index=output.index,
                    delta=message,
                    logprobs=logprobs,
                    finish_reason=finish_reason,  # type: ignore[arg-type]
                    num_preemptions=output.num_preemptions if output.finished else None,
                ))
            if body.include_usage_in_stream:
                usage = ChatCompletionChunk(
                    id=request_id, created=created, model=model, choices=[],
                    usage=_usage([prompt], list(choices.values())),
                )
                yield _sse_data(usage.model_dump_json())

        return self._stream_guard(stream, events())

    # ------------------------------------------------------ logprobs

    def _completion_choice(
        self,
        index: int,
        choice: _Choice,
        body: CompletionRequest,
        prompt: list[int],
        echo: list[str] | None,
    ) -> CompletionChoice:
        prefix = echo[index // body.n] if echo is not None else ""
        logprobs = None
        if body.logprobs is not None:
            logprobs = self._completion_logprobs(
                prompt if echo is not None else [], choice.token_ids, choice.logprobs, 0
            )
        return CompletionChoice(
            index=index,
            text=prefix + choice.text,
            logprobs=logprobs,
            finish_reason=choice.finish_reason,  # type: ignore[arg-type]
            num_preemptions=choice.num_preemptions,
        )

    def _completion_logprobs(
        self,
        prompt_ids: list[int],
        token_ids: list[int],
        logprobs: list[SampleLogprobs],
        text_offset: int,
    ) -> CompletionLogprobs:
        """Completions-shaped logprobs; echoed prompt tokens have none (not computed)."""
        result = CompletionLogprobs()
        offset = text_offset
        for token_id in prompt_ids:
            token = self._token_text(token_id)
            result.tokens.append(token)
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            result.text_offset.append(offset)
            offset += len(token)
        for token_id, sample in zip(token_ids, logprobs, strict=False):
            token = self._token_text(token_id)
            top = {self._token_text(t): lp for t, lp in sample.top}
            top.setdefault(token, sample.logprob)
            result.tokens.append(token)
            result.token_logprobs.append(sample.logprob)
            result.top_logprobs.append(top)
            result.text_offset.append(offset)
            offset += len(token)
        return result

    def _chat_logprobs(
        self, token_ids: list[int], logprobs: list[SampleLogprobs]
    ) -> ChatChoiceLogprobs:
        content = []
        for token_id, sample in zip(token_ids, logprobs, strict=False):
            token = self._token_text(token_id)
            content.append(ChatTokenLogprob(
                token=token,
                logprob=sample.logprob,
                bytes=list(token.encode()),
                top_logprobs=[
                    ChatTopLogprob(token=(t := self._token_text(tid)), logprob=lp,
                                   bytes=list(t.encode()))
                    for tid, lp in sample.top
                ],
            ))
        return ChatChoiceLogprobs(content=content)

    def _token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))


def _max_prompt_chars(tokenizer: Any, max_model_len: int) -> int | None:
    """Characters beyond which a text cannot fit in max_model_len tokens (None: unknown).

    No token decodes to more characters than its vocabulary entry has (byte-level BPE
    writes each byte as one character, SentencePiece a space as one), so a text longer
    than max_model_len x the longest entry has more tokens than the context holds.
    NOTE: a normalizer may shorten the text before it is split (NFC composes up to three
    characters into one), hence the slack when the tokenizer has one.
    """
    try:
        longest = max((len(token) for token in tokenizer.get_vocab()), default=0)
    except Exception:  # no get_vocab (or an unusual one): no limit but the tokens'
        return None
    if longest == 0:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    slack = 1 if backend is None or backend.normalizer is None else 4
    return max_model_len * longest * slack


def _has_lone_surrogate(data: Any) -> bool:
    """Whether a string anywhere in parsed JSON holds an unpaired surrogate."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _json_response(model: pydantic.BaseModel) -> Response:
    """`model` as JSON; NOTE: pydantic writes a NaN or infinite float as null, where
    JSONResponse would raise (a 500 after the work was done)."""
    return Response(model.model_dump_json(), media_type="application/json")


def _accumulate(choice: _Choice, output: RequestOutput) -> None:
    choice.text += output.text
    choice.token_ids.extend(output.token_ids)
    choice.logprobs.extend(output.logprobs or [])
    choice.num_output_tokens = output.num_output_tokens
    choice.num_preemptions = output.num_preemptions
    choice.num_cached_tokens = max(choice.num_cached_tokens, output.num_cached_tokens)
    if output.finish_reason is not None:
        choice.finish_reason = output.finish_reason


def _usage(prompts: list[list[int]], choices: Sequence[_Choice]) -> UsageInfo:
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


def _sse_data(payload: str) -> str:
    return f"data: {payload}\n\n"


def _chunk_head(request_id: str, kind: str, created: int, model: str) -> bytes:
    """`data: {"id":...,"object":...,"created":...,"model":...,"choices":[` of a stream's
    chunks, encoded once per stream."""
    head = orjson.dumps({"id": request_id, "object": kind, "created": created, "model": model})
    return b"data: " + head[:-1] + b',"choices":['


def _fast_chunk(head: bytes, output: RequestOutput, content: dict[str, Any]) -> bytes:
    """The SSE event of a chunk without logprobs, encoded with orjson: the same JSON as
    the chunk models (CompletionStreamChoice / ChatCompletionStreamChoice) write."""
    choice: dict[str, Any] = {"index": output.index, **content, "logprobs": None,
                              "finish_reason": output.finish_reason}
    if output.finished:
        choice["num_preemptions"] = output.num_preemptions
    return head + orjson.dumps(choice) + b"]}\n\n"


async def _wait_for_disconnect(raw: Request) -> None:
    """Returns when the client closes the connection (the body was already read)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return
